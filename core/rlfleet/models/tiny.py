"""Tiny Hugging Face checkpoints made on the spot: nothing is downloaded from a model hub.

`tiny-moe` is a Qwen3-MoE-style model (8 experts, top-2, 2 layers) and `tiny-dense` its
dense sibling. Both share a byte-level BPE tokenizer with no merges, so any text encodes
without unknown tokens. head_dim is 32 because vLLM's CPU attention rejects 16.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

from rlfleet.models.chat import CHAT_TEMPLATE, END_TEXT, END_TURN, SPECIAL_TOKENS

Kind = Literal["tiny-moe", "tiny-dense"]
KINDS: tuple[Kind, ...] = ("tiny-moe", "tiny-dense")

# 256 byte symbols and the special tokens, rounded up to a multiple of 64 for the kernels.
VOCAB_SIZE = 320

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=VOCAB_SIZE - 1,
    pad_token_id=None,
)


def model_config(kind: Kind, eos_token_id: int, pad_token_id: int) -> PretrainedConfig:
    ids = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    common = {**_COMMON, **ids}
    if kind == "tiny-moe":
        return Qwen3MoeConfig(
            **common,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        )
    return Qwen3Config(**common, intermediate_size=256)


def build_tokenizer() -> PreTrainedTokenizerFast:
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(byte_symbols))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_TURN,
        pad_token=END_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=_COMMON["max_position_embeddings"],
    )


def init_model(
    kind: Kind,
    directory: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    sizes: Mapping[str, int] | None = None,
) -> Path:
    """Writes a Hugging Face checkpoint (config, safetensors, tokenizer) into directory.
    `sizes` overrides the kind's config fields (`hidden_size`, ...): a larger model of the
    same architecture, for benchmarks that need bytes to move."""
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {', '.join(KINDS)}")
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids(END_TURN)
    pad = tokenizer.convert_tokens_to_ids(END_TEXT)
    config = model_config(kind, eos, pad)
    config.update(dict(sizes or {}))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    (directory / "rlfleet-model.json").write_text(json.dumps({"kind": kind, "seed": seed}) + "\n")
    return directory


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, under the names it stores them by."""
    return load_file(directory / "model.safetensors")


def train_step(directory: Path, out: Path, *, lr: float, seed: int = 0) -> Path:
    """A plausible next policy: one AdamW step (fp32 master weights) on random tokens.

    Saved as a complete checkpoint in `out`, in the checkpoint's dtype.
    """
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    dtype = getattr(torch, json.loads((directory / "config.json").read_text())["dtype"])
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=generator)
    model(input_ids=tokens, labels=tokens).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(directory).save_pretrained(out)
    shutil.copy(directory / "rlfleet-model.json", out / "rlfleet-model.json")
    return out


Example = list[tuple[str, bool]]  # pieces of one text, each trained on (True) or only read


def fine_tune(
    directory: Path,
    examples: list[Example],
    *,
    steps: int,
    lr: float = 3e-3,
    batch: int | None = None,
    seed: int = 0,
) -> None:
    """Supervised fine-tuning in place: the loss covers only the trained pieces.

    Each step trains on `batch` examples drawn at random, or on all of them if None.
    Used to teach a tiny model a format (tool calls, short answers) before RL, and by
    tests to make one follow fixed scripts when decoding greedily.
    """
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rows, labels = [], []
    for example in examples:
        ids, mask = [], []
        for text, trained in example:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            mask += [trained] * len(piece)
        rows.append(ids)
        labels.append([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    pad = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    dtype = getattr(torch, json.loads((directory / "config.json").read_text())["dtype"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # Linear decay to zero: a short run still ends settled.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        chosen = range(len(rows)) if batch is None else rng.sample(range(len(rows)), batch)
        width = max(len(rows[i]) for i in chosen)
        input_ids = torch.tensor([rows[i] + [pad] * (width - len(rows[i])) for i in chosen])
        targets = torch.tensor([labels[i] + [-100] * (width - len(labels[i])) for i in chosen])
        # No attention mask: under causal attention no real token reads the right padding,
        # and without a mask SDPA takes its causal kernel, a third faster on CPU.
        loss = model(input_ids=input_ids, labels=targets).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.to(dtype).save_pretrained(directory, safe_serialization=True)
