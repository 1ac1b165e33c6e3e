"""The capacity benchmark's workloads: a model config (random weights, no download), how it trains,
and the sizes each dimension holds fixed. Standard library only; the GPU side (build, train_step)
imports torch, transformers and peft when called."""

from __future__ import annotations

import dataclasses
from typing import Any

# The step lengths as fractions of the longest: six training steps of varying length, the longest
# twice (steps 2 and 5), so the second one runs on memory the shorter steps have fragmented.
LENGTH_FRACTIONS = (0.55, 1.0, 0.3, 0.8, 1.0, 0.45)
STEPS = len(LENGTH_FRACTIONS)

# GPT-2-medium with 8192 learned positions (the planner counts them), so its sequence can grow
# past 1024 while the micro-batch is held at 4.
GPT2M = {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16,
         "n_positions": 8192, "vocab_size": 50257, "activation_function": "gelu_new"}
LLAMA1B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22,
           "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
           "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": False,
           "max_position_embeddings": 65536}


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and how it trains (bf16 autocast, AdamW lr 1e-4, fused SDPA attention).
    `seq_for_batch`: the longest sequence while the micro-batch is searched; `batch_for_seq`: the
    micro-batch while the sequence is searched; `seq_bound`: the longest sequence the model
    takes."""
    name: str
    title: str
    config: dict[str, Any]
    seq_for_batch: int
    batch_for_seq: int
    seq_bound: int
    checkpointing: bool = False
    lora_rank: int = 0  # LoRA on q, k, v, o over a frozen bf16 base; 0: full fine-tuning

    def shape(self, dim: str, size: int) -> tuple[int, int]:
        """(micro-batch, longest sequence) of a trial of `size` along `dim` ("batch" or "seq")."""
        return (size, self.seq_for_batch) if dim == "batch" else (self.batch_for_seq, size)

    def plan_flags(self) -> dict[str, Any]:
        """The planner's Setup fields that describe this workload's training."""
        return {"checkpointing": self.checkpointing, "lora_rank": self.lora_rank,
                "lora_targets": "attn", "precision": "bf16-mixed", "optimizer": "adamw"}


WORKLOADS = {w.name: w for w in (
    Workload("gpt2m", "GPT-2-medium", GPT2M, seq_for_batch=1024, batch_for_seq=4,
             seq_bound=GPT2M["n_positions"]),
    Workload("llama1b", "Llama-1B", LLAMA1B, seq_for_batch=2048, batch_for_seq=1,
             seq_bound=LLAMA1B["max_position_embeddings"]),
    Workload("llama1b-ckpt", "Llama-1B + checkpointing", LLAMA1B, seq_for_batch=2048,
             batch_for_seq=8, seq_bound=LLAMA1B["max_position_embeddings"], checkpointing=True),
    Workload("llama1b-lora", "Llama-1B LoRA r16 + checkpointing", LLAMA1B, seq_for_batch=4096,
             batch_for_seq=8, seq_bound=LLAMA1B["max_position_embeddings"], checkpointing=True,
             lora_rank=16),
)}


BATCH_BOUND = 4096  # the largest micro-batch a search tries


def add_row_arguments(parser) -> None:
    """The positional arguments that name one row's size: WORKLOAD CAP_GIB DIM SIZE (an
    argparse parser; check_row() checks the values)."""
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("cap_gib", type=float)
    parser.add_argument("dim", choices=("batch", "seq"))
    parser.add_argument("size", type=int)


def check_row(parser, args) -> None:
    """parser.error() (status 2) for a size below 1 or a cap that is not above 0."""
    if args.size < 1 or not args.cap_gib > 0:
        parser.error(f"size must be at least 1 and cap_gib above 0, got {args.size}, "
                     f"{args.cap_gib:g}")


def size_grid(w: Workload, dim: str, seq_step: int) -> tuple[int, int]:
    """(step, bound) of the sizes searched along `dim`: micro-batches 1 apart up to BATCH_BOUND,
    sequences `seq_step` apart up to the longest the model takes."""
    return (1, BATCH_BOUND) if dim == "batch" else (seq_step, w.seq_bound)


def lengths(longest: int) -> list[int]:
    """The sequence length of each of the STEPS steps whose longest is `longest`."""
    return [max(1, round(f * longest)) for f in LENGTH_FRACTIONS]


def build(torch, w: Workload, device: str = "cuda"):
    """The model on `device` (random weights, seed 0) and its AdamW over the trainable weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    config = AutoConfig.for_model(**w.config)
    dtype = torch.get_default_dtype()
    if w.lora_rank:  # the frozen base in bf16, as LoRA fine-tunes are run (and planned)
        torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(dtype)
    if w.lora_rank:
        from peft import LoraConfig, get_peft_model
        # Non-reentrant checkpointing: the frozen embedding's output needs no gradient for the
        # adapters inside a checkpointed layer to get theirs.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = get_peft_model(model, LoraConfig(
            r=w.lora_rank, lora_alpha=2 * w.lora_rank, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"))
    elif w.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def train_step(torch, model, opt, vocab: int, batch: int, seq: int, device: str = "cuda"):
    """One step on random tokens: bf16 autocast forward, backward, AdamW, gradients to None.
    Returns the loss as a tensor, without waiting for the GPU: it returns when the host has
    queued the step's work (or an allocator's call waited on the GPU)."""
    x = torch.randint(0, vocab, (batch, seq), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()
