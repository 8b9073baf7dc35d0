"""``plait bench tp --dp N --tp M``: the two placements of a ``dp × tp`` mesh, measured and
predicted side by side.

Every rank builds the same model (plait's GPT, or ``--model hf-llama``) from
the same seed once per placement (:data:`plait.perf.placement.PLACEMENTS`):

- ``tp-inside-host``: a tp group is ``tp`` consecutive ranks, on one host
  (hosts hold ranks in contiguous blocks); data parallelism crosses hosts;
- ``tp-across-hosts``: a tp group's ranks are ``dp`` apart, one per host;
  each replica is on one host and tensor parallelism crosses the link.

Each copy is made tensor-parallel by plait on its placement's tp group (fused
operators, ``overlap=True``; ``plait-plain``: ``overlap=False``) and
data-parallel by PyTorch on its dp group (:func:`plait.parallel.data_parallel`,
"auto": FSDP2 where every gradient goes through autograd, else DDP). Both see
the same global batches; replica ``d`` trains on rows ``[d·B/dp, (d+1)·B/dp)``
and the logged loss is the replicas' mean, the global batch's. One micro-batch
(``interleaved_blocks`` runs a block's branches without calling the block, so
FSDP2's per-block hooks would not gather its parameters). Steps of the copies
are interleaved (step i of each in balanced orders, then step i + 1);
``t_step_s`` is the median over the timed steps of the slowest rank's time.

Beside each measurement, ``predicted_step_s``:
:func:`plait.perf.placement.predict_placement` with this run's figures: its
FLOPs at the rate the model's own single-device step reaches here on a
rank's share of the tokens while every rank runs one (measured before the
steps), the link's rate (``--link``) shared by the ranks of a host, the bandwidth and latency of an all-reduce between the
ranks of one host (a line through its times at the tp buffer's size and 8
times that, measured likewise), and the latency of the ops calibration for a
collective that crosses hosts.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from ..ops import get_context
from ..parallel.data import MeshLayout, data_parallel
from ..perf.placement import (PLACEMENTS, Hardware, StepWork, predict_placement,
                              transformer_flops)
from ..runtime import parse_rate, rank_context
from ..runtime.priority import raise_comm_threads
from ..runtime.timing import agreed_max, balanced_round, median, time_once, time_repeated
from ..training.data import CharCorpus
from ..training.dp_tp import placement_line
from ..training.loop import Trainer
from ..training.models import build_gpt, gpt_loss, make_optimizer
from .report import print_table

__all__ = ["run_placement_bench", "placement_work", "summarize_placements", "print_placements"]

PART = "placement"
TIMING_ROUNDS = 5  # of the compute rate and the in-host all-reduce, before the steps


# --- one rank -----------------------------------------------------------------------------
def _build(cfg, system: str, layout: MeshLayout, vocab_size: int):
    """(the dp × tp model, its tensor-parallel module, mesh) of one placement."""
    from . import tp_hf

    device = rank_context().topology.device
    mesh = layout.mesh(device.type)
    overlap = system == "plait"
    if cfg.model == "hf-llama":
        from ..parallel import parallelize

        model = tp_hf.build_llama(cfg, vocab_size).to(device)
        plan = "auto" if cfg.hf_plan == "auto" else tp_hf.own_plan(model, cfg.hf_plan)
        tp_model = parallelize(model, plan, mesh=mesh["tp"], overlap=overlap, chunks="auto")
    else:
        train_cfg = replace(cfg.train_config(overlap=overlap), microbatches=1)
        tp_model = build_gpt(train_cfg, mesh.get_group("tp"), vocab_size).to(device)
    return data_parallel(tp_model, mesh), tp_model, mesh


def _copies(cfg, vocab_size: int) -> dict:
    """Per (system, placement): its trainer, replica rows, tp module, mesh."""
    from . import tp_hf

    loss_fn = tp_hf.llama_loss if cfg.model == "hf-llama" else gpt_loss
    built = {}
    for system in cfg.systems:
        for placement, inside in PLACEMENTS.items():
            layout = MeshLayout(dp=cfg.dp, tp=cfg.tp, tp_inside_host=inside)
            model, tp_model, mesh = _build(cfg, system, layout, vocab_size)
            rows = cfg.batch_size // cfg.dp
            d = mesh.get_local_rank("dp")
            opt = make_optimizer(model, cfg.lr, cfg.optimizer)
            built[(system, placement)] = dict(trainer=Trainer(model, opt, loss_fn),
                                              rows=slice(d * rows, (d + 1) * rows),
                                              tp_model=tp_model, mesh=mesh, layout=layout,
                                              dp_kind="DDP" if model is not tp_model else "FSDP2")
    return built


def _train(cfg, built: dict, batches: list) -> dict:
    device, ctx = rank_context().topology.device, rank_context()
    own = {key: [] for key in built}
    times = {key: [] for key in built}
    keys = list(built)
    for i, batch in enumerate(batches):
        for key in balanced_round(keys, i):
            c = built[key]
            share = tuple(t[c["rows"]] for t in batch)
            times[key].append(time_once(  # the loss read waits for the step to finish
                lambda: own[key].append(c["trainer"].step(i, share)["loss"]), device))
        ctx.report({"part": PART, "step": i, "of": len(batches)})
    losses = {}
    for key, c in built.items():  # the replicas' mean: the global batch's loss
        seen = torch.tensor(own[key], dtype=torch.float64, device=device)
        dist.all_reduce(seen, group=c["mesh"].get_group("dp"))
        losses[key] = (seen / cfg.dp).tolist()
    return {"losses": losses, "times": {k: agreed_max(v) for k, v in times.items()}}


def _compute_rate(cfg, vocab: int, batch: tuple) -> float:
    """FLOP/s of this model's own step (forward, backward, update) with no communication: the
    single-device model on ``B/(dp·tp)`` rows, a rank's share of the tokens, timed on every
    rank at once (each time the slowest rank's; the median of the rounds), so it holds what
    a FLOP count leaves out (norms, softmax, the optimizer, Python) and the cores' sharing."""
    from . import tp_hf
    from ..models import GPT

    device = rank_context().topology.device
    torch.manual_seed(cfg.seed)
    if cfg.model == "hf-llama":
        model, loss_fn = tp_hf.build_llama(cfg, vocab).to(device), tp_hf.llama_loss
    else:
        model, loss_fn = GPT(cfg.train_config().gpt_config(vocab)).to(device), gpt_loss
    trainer = Trainer(model, make_optimizer(model, cfg.lr, cfg.optimizer), loss_fn)
    rows = max(1, cfg.batch_size // (cfg.dp * cfg.tp))
    share = tuple(t[:rows] for t in batch)
    trainer.step(0, share)  # warm-up
    times = time_repeated(lambda: trainer.step(0, share), TIMING_ROUNDS, device)
    block, head, _ = _shapes(cfg, vocab, tp=1)
    flops = transformer_flops(tokens=rows * cfg.seq_len, layers=cfg.n_layer, tp=1,
                              sharded_weights=block, seq_len=cfg.seq_len, width=cfg.n_embd,
                              replicated_weights=head)
    return flops / median(times)


def _intra_link(built: dict, nbytes: float) -> tuple[float, float]:
    """(bytes/s, latency per ring step) of an all-reduce among ranks of one host (the tp
    groups of ``tp-inside-host``, every group at once), from its times at ``nbytes`` and at
    8 × ``nbytes``: a line through the two (bandwidth alone where the larger is not slower)."""
    key = next(k for k in built if k[1] == "tp-inside-host")
    group = built[key]["mesh"].get_group("tp")
    n, device = dist.get_world_size(group), rank_context().topology.device
    points = []
    for size in (nbytes, 8 * nbytes):
        buf = torch.zeros(max(1, int(size) // 4), device=device)
        dist.all_reduce(buf, group=group)  # warm the connection
        t = median(time_repeated(lambda: dist.all_reduce(buf, group=group), TIMING_ROUNDS,
                                 device))
        points.append((2.0 * (n - 1) / n * buf.numel() * 4, t))  # (wire bytes, seconds)
    (w1, t1), (w2, t2) = points
    if t2 <= t1:
        return w2 / t2, 0.0
    rate = (w2 - w1) / (t2 - t1)
    return rate, max(0.0, t1 - w1 / rate) / (2 * (n - 1))


def placement_work(cfg, system: str, params_per_rank: int, dp_kind: str, vocab: int) -> StepWork:
    """What one rank does per step: FLOPs of the sharded block linears, attention and the LM
    head; the tp all-reduces of ``[B/dp, S, D]`` fp32; its gradients over dp."""
    tokens = cfg.batch_size // cfg.dp * cfg.seq_len
    d = cfg.n_embd
    block, head, allreduces = _shapes(cfg, vocab, cfg.tp)
    flops = transformer_flops(tokens=tokens, layers=cfg.n_layer, tp=cfg.tp,
                              sharded_weights=block, seq_len=cfg.seq_len, width=d,
                              replicated_weights=head)
    return StepWork(dp=cfg.dp, tp=cfg.tp, flops=flops, layers=cfg.n_layer,
                    tp_allreduces=allreduces if cfg.tp > 1 else 0,
                    tp_allreduce_bytes=tokens * d * 4, dp_bytes=params_per_rank * 4,
                    dp_kind="fsdp" if dp_kind == "FSDP2" else "ddp",
                    tp_pieces=1 if system == "plait-plain" else _pieces())


def _shapes(cfg, vocab: int, tp: int) -> tuple[float, float, int]:
    """(weight elements of a block, of the LM head on one of ``tp`` ranks, all-reduces a step
    on the tp axis)."""
    from . import tp_hf

    d = cfg.n_embd
    if cfg.model == "hf-llama":
        kv = d // cfg.n_head * cfg.n_kv_head
        block = 2 * d * d + 2 * d * kv + 3 * d * tp_hf.ffn_width(d)
        head = d * tp_hf.padded_vocab(vocab) / (tp if cfg.hf_plan == "auto" else 1)
        return block, head, 4 * cfg.n_layer + (2 if cfg.hf_plan == "auto" else 0)
    return 12 * d * d, d * vocab, 4 * cfg.n_layer


def _pieces() -> int:
    """The most pieces plait's fused operators took on this rank's groups (1: none fused)."""
    from ..ops.context import _CONTEXTS

    return max((d.chunks for c in _CONTEXTS.values() for d in c.decisions.values()
                if d.path == "fused"), default=1)


def _hardware(cfg, flops_per_s: float, intra: tuple[float, float]) -> Hardware:
    calibration = get_context().calibration().profile
    rate = parse_rate(rank_context().link)
    hosts = cfg.extra.get("hosts", 0)
    return Hardware(hosts=hosts, flops_per_s=flops_per_s, intra_Bps=intra[0],
                    intra_latency_s=intra[1],
                    inter_Bps=rate / 8 if rate and hosts > 1 else None,
                    latency_s=calibration.latency_s,
                    per_piece_overhead_s=calibration.per_piece_overhead_s,
                    overlap_slowdown=calibration.overlap_slowdown)


def run_placement_bench(cfg) -> list[dict]:
    """On every rank of an initialised group: both placements trained interleaved, one record
    per (system, placement), each with its prediction."""
    get_context().calibration()  # once, before anything is timed
    corpus = CharCorpus.load()
    stream = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
    device = rank_context().topology.device
    batches = [tuple(t.to(device) for t in next(stream)) for _ in range(cfg.total_steps)]
    built = _copies(cfg, corpus.vocab_size)
    raise_comm_threads()
    flops_per_s = _compute_rate(cfg, corpus.vocab_size, batches[0])
    tokens = cfg.batch_size // cfg.dp * cfg.seq_len
    intra = _intra_link(built, tokens * cfg.n_embd * 4)
    run = _train(cfg, built, batches)
    hw = _hardware(cfg, flops_per_s, intra)
    records = [_record(cfg, key, c, run, hw, corpus.vocab_size) for key, c in built.items()]
    return _with_diffs(records, cfg)


def _record(cfg, key, c: dict, run: dict, hw: Hardware, vocab: int) -> dict:
    from .tp_hf import model_info

    system, placement = key
    # FSDP2's parameters are DTensors sharded over dp whose global shape is the tp shard
    params = sum(p.numel() for p in c["tp_model"].parameters())
    work = placement_work(cfg, system, params, c["dp_kind"], vocab)
    predicted = predict_placement(work, hw, placement)
    steps = run["times"][key]
    t_step = median(steps[cfg.warmup:])
    hosts = cfg.extra.get("hosts", 0)
    world = cfg.dp * cfg.tp
    per_host = world // hosts if hosts > 1 else world
    tokens = cfg.batch_size * cfg.seq_len
    return {"system": system, "part": PART, "placement": placement,
            "tp_inside_host": PLACEMENTS[placement], "dp": cfg.dp, "tp": cfg.tp,
            "tp_groups": c["layout"].tp_groups(), "dp_groups": c["layout"].dp_groups(),
            "host_ranks": [list(range(h, h + per_host)) for h in range(0, world, per_host)],
            "across_hosts": predicted.across_hosts if hosts > 1 else "nothing (one machine)",
            "placement_line": _line(c["layout"], hosts),
            "dp_kind": c["dp_kind"], "t_step_s": t_step, "tokens_per_s": tokens / t_step,
            "predicted_step_s": predicted.step_s, "prediction": predicted.to_dict(),
            "work": asdict(work), "hardware": asdict(hw),
            "losses": run["losses"][key], "step_times_s": steps,
            "tokens_per_step": tokens, "world_size": world, "model": model_info(cfg, vocab),
            "optimizer": cfg.optimizer, "lr": cfg.lr, "warmup": cfg.warmup, "steps": cfg.steps,
            "link": rank_context().link, "backend": rank_context().topology.backend,
            **cfg.extra}


def _line(layout: MeshLayout, hosts: int) -> str:
    return placement_line(layout, hosts)


def _with_diffs(records: list[dict], cfg) -> list[dict]:
    """Each record's largest |Δloss| against the same system's other placement: over the
    first ``compare_steps`` and over the timed steps."""
    for r in records:
        other = next(o for o in records if o["system"] == r["system"] and o is not r)
        pairs = list(zip(r["losses"], other["losses"]))
        n = min(cfg.compare_steps, cfg.total_steps)
        r["loss_diff_vs"] = other["placement"]
        r["max_loss_diff"] = max(abs(a - b) for a, b in pairs[:n])
        r["compare_steps"] = n
        r["max_loss_diff_timed"] = max(abs(a - b) for a, b in pairs[cfg.warmup:])
    return records


# --- what the user sees -------------------------------------------------------------------
def summarize_placements(records: list[dict]) -> dict:
    """Per system: measured and predicted ratio of tp-across-hosts to tp-inside-host, and
    whether the placements' losses agree (fp32, 1e-5 over the timed steps)."""
    out = {}
    for system in dict.fromkeys(r["system"] for r in records if r.get("part") == PART):
        by = {r["placement"]: r for r in records
              if r.get("part") == PART and r["system"] == system}
        inside, across = by["tp-inside-host"], by["tp-across-hosts"]
        key = system.replace("-", "_")
        out[f"{key}_across_over_inside_measured"] = across["t_step_s"] / inside["t_step_s"]
        out[f"{key}_across_over_inside_predicted"] = (across["predicted_step_s"]
                                                      / inside["predicted_step_s"])
        out[f"{key}_placement_max_loss_diff_timed"] = inside["max_loss_diff_timed"]
    diffs = [v for k, v in out.items() if k.endswith("_timed")]
    if diffs:
        out["placement_losses_agree_1e-5"] = max(diffs) <= 1e-5
    return out


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


def print_placements(records: list[dict], to=None) -> None:
    """The placements table: per system and placement, which axis crosses hosts, the measured
    median step, the prediction and its parts, and the loss difference between placements."""
    rows = [r for r in records if r.get("part") == PART]
    if not rows:
        return
    first = rows[0]
    m = first["model"]
    rows_out = []
    for r in rows:
        p = r["prediction"]
        rows_out.append([r["system"], r["placement"], r["across_hosts"],
                         f"{r['tp_groups']}", _ms(r["t_step_s"]),
                         f"{_ms(r['predicted_step_s'])} = {_ms(p['compute_s'])} + "
                         f"{_ms(p['tp_part_s'] - p['compute_s'])} + {_ms(p['dp_exposed_s'])}",
                         f"{r['predicted_step_s'] / r['t_step_s']:.2f}",
                         f"{r['max_loss_diff_timed']:.1e}"])
    hosts = first.get("hosts", 0)
    where = f"{hosts} hosts, {first['link']}" if hosts else "one machine (loopback)"
    print_table(f"placements of dp {first['dp']} × tp {first['tp']} on {where}: "
                f"{m['name']} {m['n_layer']}×{m['n_embd']}, batch {m['batch_size']}×"
                f"{m['seq_len']}, {first['optimizer']}, dp by {first['dp_kind']}",
                ["system", "placement", "across hosts", "tp groups", "step (ms)",
                 "predicted (ms) = compute + tp comm + dp exposed", "pred / meas",
                 "max |Δloss| timed"], rows_out, labels=4, to=to,
                caption=(f"median over {first['steps']} timed steps after {first['warmup']} "
                         "warm-up, each step's time the slowest rank's; placements' steps "
                         "interleaved; predicted: plait.perf.placement (compute at the rate "
                         "measured here for the model's own step on a rank's share of the "
                         "tokens, the link's rate shared by a host's ranks); |Δloss| against "
                         "the other placement"))
