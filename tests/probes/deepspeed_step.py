"""Takes one DeepSpeed training step on a checkpoint (CPU accelerator) and writes a JSON report."""

import json
import os
import sys
from pathlib import Path


def main() -> None:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoModelForCausalLM

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    # The CPU accelerator defaults to oneCCL; one process needs only gloo.
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1},
            "gradient_clipping": 1.0,
        },
    )
    tokens = torch.randint(0, 256, (2, 24))
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    with torch.no_grad():
        loss_after = engine(input_ids=tokens, labels=tokens).loss.item()
    changed = sum(
        not torch.equal(before[name], p.detach()) for name, p in engine.module.named_parameters()
    )
    Path(sys.argv[2]).write_text(
        json.dumps(
            {
                "accelerator": get_accelerator().device_name(),
                "loss_before": loss.item(),
                "loss_after": loss_after,
                "changed_parameters": changed,
                "global_steps": engine.global_steps,
            }
        )
    )


if __name__ == "__main__":
    main()
