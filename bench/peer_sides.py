"""The peers' side of bench/data_parallel.py: a plain training loop around PyTorch's DDP or
FSDP2 or DeepSpeed's ZeRO engine, on fivefold's model definition (a plain nn.Module) with
the bench's hyper-parameters, batches cut from the same token array. It uses none of
fivefold's trainer, engine, sampler or optimizer construction. `import_side` loads any side's
libraries (fivefold's too) before the bench takes a rank's baseline resident set.
"""

from __future__ import annotations

from harness import plain_adamw, plain_lr, random_batch


class PeerSide:
    """A plain training loop around a peer's data-parallel wrapper of the same model."""

    def __init__(self, spec: dict, rank: int, world: int):
        import numpy as np
        import torch

        from fivefold.config import ModelConfig  # only to build the model definition
        from fivefold.models.llama import Transformer

        self.torch, self.F = torch, torch.nn.functional
        self.side, self.world = spec["side"], world
        self.hp, self.total_steps = spec["train"], spec["total_steps"]
        self.rows, self.seq_len = spec["global_batch"] // world, spec["model"]["seq_len"]
        self.tokens = np.load(spec["train_tokens"], mmap_mode="r")
        self.rng = np.random.default_rng([1234, rank])
        torch.manual_seed(0)  # the same initial weights on every rank
        model = Transformer(ModelConfig(**spec["model"]))
        with torch.no_grad():  # GPT-2 style normal(0, 0.02), as fivefold initializes
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.02)
        self.model, self.opt = self._wrap(model)
        self.step = 0

    def _wrap(self, model):
        if self.side == "torch-ddp":
            from torch.nn.parallel import DistributedDataParallel
            return DistributedDataParallel(model), plain_adamw(list(model.parameters()), self.hp)
        if self.side == "torch-fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (self.world,))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, plain_adamw(list(model.parameters()), self.hp)
        import deepspeed
        client = plain_adamw(list(model.parameters()), self.hp)
        config = {"train_batch_size": self.rows * self.world,
                  "train_micro_batch_size_per_gpu": self.rows,
                  "gradient_accumulation_steps": 1,
                  "gradient_clipping": self.hp["grad_clip"],
                  # persistence threshold 0: ZeRO-3 shards every parameter, as fivefold-3 and
                  # FSDP2 do (the default 1e5 would keep this model's attention matrices whole)
                  "zero_optimization": {"stage": int(self.side.split("-")[1]),
                                        "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10**9}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
        return engine, client  # ZeRO keeps the client's param_groups: the learning rate goes there

    def run(self, n: int) -> float:
        torch, F = self.torch, self.F
        deepspeed = self.side.startswith("deepspeed")
        loss = torch.zeros(())
        for _ in range(n):
            self.model.train()
            for group in self.opt.param_groups:
                group["lr"] = plain_lr(self.hp, self.step, self.total_steps)
            x_BT, y_BT = random_batch(self.tokens, self.rng, self.rows, self.seq_len)
            # one expression, so the (B, T, V) logits are not kept alive into the next step
            loss = F.cross_entropy(self.model(x_BT).flatten(0, 1), y_BT.flatten())
            if deepspeed:  # the engine clips (config) and steps its ZeRO optimizer
                self.model.backward(loss)
                self.model.step()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hp["grad_clip"])
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            loss = loss.detach()
            self.step += 1
        total = loss.clone()  # the global mean of the last step's loss, for the log
        torch.distributed.all_reduce(total)
        return total.item() / self.world

    def report(self) -> dict:
        return {}


def import_side(side: str) -> None:
    """Load the side's libraries before the baseline RSS is taken."""
    if side.startswith("fivefold"):
        import fivefold.train.trainer  # noqa: F401
    elif side.startswith("deepspeed"):
        import logging

        import deepspeed  # noqa: F401
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    else:
        import torch.distributed.fsdp  # noqa: F401
        import torch.nn.parallel  # noqa: F401
