"""A transformers Llama, tensor-parallel by plait: torchrun --nproc-per-node 2 train_hf_llama.py"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import plait
from plait.runtime import init_from_env

topology = init_from_env()  # torchrun's RANK, WORLD_SIZE, ... (plain python: a world of one)
torch.manual_seed(0)  # every rank builds the same model; parallelize keeps its share
config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
model = plait.parallelize(LlamaForCausalLM(config), plan="auto")  # the model's own tp_plan
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
for step in range(10):
    batch = data[2 * (step % 2):][:2]  # every rank the same batch (tensor parallelism)
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if topology.rank == 0:
        print(f"step {step} loss {loss.item():.5f}", flush=True)
