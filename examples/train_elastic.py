"""Elastic GPT training that survives losing a host, under torchrun's elastic agent.

On every host (one agent each; the c10d rendezvous store on HOST0):

    torchrun --nnodes 2:3 --nproc-per-node 1 --max-restarts 3 \\
        --rdzv-backend c10d --rdzv-endpoint HOST0:29400 --rdzv-id run1 \\
        examples/train_elastic.py --root /shared/run1 --steps 60 --checkpoint-every 5

A lost host makes the others' workers fail; their agents restart them in a smaller world,
and each incarnation resumes from the newest checkpoint under /shared/run1, resharded onto
its own plan. ``plait elastic --hosts 3 --kill-host 2@20`` does all of this on an emulated
cluster. Plain ``python examples/train_elastic.py --root DIR`` trains as one process.
"""
import sys

from plait.elastic.worker import main

if __name__ == "__main__":
    sys.exit(main())
