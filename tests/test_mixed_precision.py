"""Mixed precision against a reference that applies the same recipe, unsharded.

The recipe ("bf16-mixed"): each rank computes with bf16 copies of the fp32 master weights under
autocast; gradients are reduced in fp32 (the mean over ranks), kept as bf16 between steps, and the
fp32 master is updated by AdamW in fp32. The reference does exactly that in one process, one rank's
local batch at a time, on the unsharded model. Tolerance: rtol 1.6e-2, about two bf16 ulps.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils.data import TensorDataset

from lightning_shardlab import ShardLabConfig, ShardLabStrategy, shard_model, shard_optimizer
from lightning_shardlab.core.config import PrecisionPolicy
from tests.helpers.launch import run_ranks
from tests.helpers.reference import RankOrderDDP, init_from_env, mean_over_ranks, reference_shard, shutdown
from tests.models import MuonGPT, OddNet, OrderedData, TinyGPT, regression_batches, token_dataset

BF16 = {"rtol": 1.6e-2, "atol": 1e-5}
# Against Lightning's DDP in the same precision, the weights' distance over the update's (``_update_gap``): the
# recipes differ (low-precision copies of every weight, norms and embeddings included, against autocast on fp32
# weights), so fp32 tolerance does not apply. Measured on the tiny GPT on CPU: 0.022 in 16-mixed (3 steps, one
# skipped), 0.034 in bf16-mixed (6 steps); with half of every reduced gradient negated, 1.44.
MIXED_UPDATE_GAP = 0.1


class SameRecipe:
    """The unsharded reference: fp32 master, bf16 compute copy, per-rank grads averaged in fp32, kept in bf16."""

    def __init__(self, master: torch.nn.Module, lr: float = 1e-2) -> None:
        self.master = master
        self.optimizer = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.1)

    def step(self, local_batches: list[tuple], loss_fn) -> torch.Tensor:  # noqa: ANN001
        compute = copy.deepcopy(self.master).to(torch.bfloat16)
        grads = [torch.zeros_like(p) for p in self.master.parameters()]
        losses = []
        for batch in local_batches:
            compute.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(compute, batch)
            loss.backward()
            losses.append(loss.detach().float())
            for g, p in zip(grads, compute.parameters()):
                g += p.grad.float()
        for g, p in zip(grads, self.master.parameters()):
            p.grad = (g / len(local_batches)).bfloat16().float()  # reduced in fp32, kept as bf16
        self.optimizer.step()
        self.optimizer.zero_grad()
        return torch.stack(losses).mean()


def _mse(model, batch):  # noqa: ANN001, ANN202
    x, y = batch
    return F.mse_loss(model(x), y)


def core_bf16_mixed(stage: int, steps: int = 8, local_batch: int = 3) -> dict:
    comm = init_from_env()
    torch.manual_seed(0)
    master = OddNet()
    model = copy.deepcopy(master)
    sharded = shard_model(model, ShardLabConfig(stage=stage), comm, PrecisionPolicy(compute_dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    shard_optimizer(optimizer, sharded)
    reference = SameRecipe(master)
    n = comm.world_size
    for step, (x, y) in enumerate(regression_batches(steps, local_batch * n)):
        batches = [
            (x[r * local_batch : (r + 1) * local_batch], y[r * local_batch : (r + 1) * local_batch]) for r in range(n)
        ]
        optimizer.zero_grad()
        with sharded.step(keep_root_gathered=True), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _mse(model, batches[comm.rank])
        sharded.prepare_backward(loss)
        loss.backward()
        optimizer.step()
        ref_loss = reference.step(batches, _mse)
        assert_close(mean_over_ranks(loss.float(), comm), ref_loss, **BF16, msg=lambda m: f"loss, step {step}\n{m}")
        for fp in sharded.flat_params:
            assert fp.full.dtype == torch.bfloat16 and fp.master.dtype == torch.float32
            assert fp.grad_shard is not None and fp.grad_shard.dtype == torch.bfloat16
            assert fp.master_grad is None  # the fp32 copy lives only until the optimizer's step
            assert_close(
                fp.master,
                reference_shard(fp, reference.master),
                **BF16,
                msg=lambda m, name=fp.layout.name: f"master {name}, step {step}\n{m}",
            )
    shutdown()
    return {}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_matches_the_same_recipe_unsharded(stage: int) -> None:
    run_ranks("tests.test_mixed_precision:core_bf16_mixed", 2, {"stage": stage}, timeout=120)


def _bf16_fit(
    model: L.LightningModule,
    data: TensorDataset,
    world_size: int,
    stage: int | None,
    accelerator: str = "cpu",
    **limits: int,
) -> L.Trainer:
    """``model`` trained in "bf16-mixed" by the shardlab strategy at ``stage`` (None: by Lightning's DDP), rank r on
    samples r, r + N, ...; on a GPU every rank shares it (the proxy; DDP over gloo)."""
    per_device = world_size if accelerator == "cuda" else 1
    if stage is None:
        strategy = RankOrderDDP(ranks_per_device=per_device) if per_device > 1 else "ddp"
    else:
        strategy = ShardLabStrategy(stage=stage, ranks_per_device=per_device)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=world_size // per_device,
        strategy=strategy,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **limits,
    )
    trainer.fit(model, OrderedData(data, 2))
    return trainer


def _replay(reference: SameRecipe, data: TensorDataset, world_size: int, steps: int, loss_fn) -> None:  # noqa: ANN001
    """The reference steps on the same global batches: each rank's local batch of each step."""
    tokens, targets = data.tensors
    for step in range(steps):
        batches = []
        for r in range(world_size):
            idx = torch.arange(step * 2 * world_size + r, (step + 1) * 2 * world_size, world_size)
            batches.append((tokens[idx], targets[idx]))
        reference.step(batches, loss_fn)


def trainer_bf16_mixed(world_size: int, steps: int = 6, stage: int = 3, accelerator: str = "cpu") -> dict:
    """Through the Trainer: precision="bf16-mixed" with the shardlab strategy, on a tiny GPT: the same recipe
    unsharded on CPU to bf16 tolerance, and Lightning's DDP in "bf16-mixed" (autocast on fp32 weights, another
    recipe) within ``MIXED_UPDATE_GAP`` (rank 0 returns the gap)."""
    torch.manual_seed(0)
    model = TinyGPT()
    master, ddp = copy.deepcopy(model), copy.deepcopy(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    data = token_dataset(steps * 2 * world_size)
    trainer = _bf16_fit(model, data, world_size, stage, accelerator, max_steps=steps)
    assert trainer.precision == "bf16-mixed"
    state = {k: v.cpu() for k, v in trainer.strategy.full_state_dict().items()}
    _bf16_fit(ddp, data, world_size, None, accelerator, max_steps=steps)
    if trainer.global_rank != 0:
        return {}
    reference = SameRecipe(master, lr=master.hparams.lr)
    reference.optimizer = master.configure_optimizers()
    _replay(reference, data, world_size, steps, lambda m, b: m.loss(b))
    for key, value in master.state_dict().items():
        assert state[key].dtype == torch.float32, key  # the full state dict holds the fp32 masters
        assert_close(state[key], value, **BF16, msg=lambda m, k=key: f"{k}\n{m}")
    gap = _update_gap(state, {k: v.float().cpu() for k, v in ddp.state_dict().items()}, initial)
    assert gap < MIXED_UPDATE_GAP, f"stage {stage}: {gap:.3f} of the update from DDP's weights"
    return {"from_ddp": gap}


def test_bf16_mixed_through_the_trainer() -> None:
    run_ranks("tests.test_mixed_precision:trainer_bf16_mixed", 2, {"world_size": 2}, timeout=180)


class Both:
    """Several optimizers stepped after one backward, as one (the reference's ``optimizer``)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()


def two_optimizers_bf16_mixed(stages: list[int], world_size: int = 2, steps: int = 4) -> dict:
    """Muon on the blocks' matrices and AdamW on the rest, stepped one after the other after one backward, in
    bf16-mixed: parameters of both share flat parameters, so the first step must leave the second optimizer's
    fp32 gradients in place (each of its parameters is stepped: it has state, and equals the same recipe)."""
    data = token_dataset(steps * 2 * world_size)
    for stage in stages:
        torch.manual_seed(0)
        model = MuonGPT()
        master = copy.deepcopy(model)
        trainer = _bf16_fit(model, data, world_size, stage, max_epochs=1)
        muon, adamw = trainer.optimizers
        trained = [p for g in adamw.param_groups for p in g["params"] if p.requires_grad]
        assert all("exp_avg" in adamw.state.get(p, {}) for p in trained), f"stage {stage}: AdamW skipped parameters"
        state = trainer.strategy.full_state_dict()
        if trainer.global_rank != 0:
            continue
        reference = SameRecipe(master)
        reference.optimizer = Both(master.configure_optimizers())
        _replay(reference, data, world_size, steps, lambda m, b: m.gpt.loss(b))
        for key, value in master.state_dict().items():
            assert_close(state[key], value, **BF16, msg=lambda m, k=key: f"stage {stage}, {k}\n{m}")
    return {}


def test_two_optimizers_after_one_backward_in_bf16_mixed() -> None:
    run_ranks("tests.test_mixed_precision:two_optimizers_bf16_mixed", 2, {"stages": [2, 3]}, timeout=180)


def _update_gap(final: dict, reference: dict, initial: dict) -> float:
    """How far ``final`` is from ``reference``, over how far training moved ``reference`` from ``initial`` (L2 over
    all weights; 0.0 where ``final`` is empty: a rank > 0 of a sharded run)."""
    if not final:
        return 0.0
    gap = torch.cat([(final[k] - reference[k]).flatten() for k in final]).norm()
    return (gap / torch.cat([(reference[k] - initial[k].float()).flatten() for k in final]).norm()).item()


def fp16_overflow_skips_on_every_rank(
    stages: list[int], tmp: str, accelerator: str = "cpu", ranks_per_device: int = 1
) -> dict:
    """16-mixed under Lightning ``ddp`` and shardlab at each stage: one rank overflows at step 2; every rank skips
    that step and halves the scale of the GradScaler at ``trainer.precision_plugin.scaler``, as DDP's does; how
    far the final weights are from DDP's, relative to how far DDP's moved (``_update_gap``, rank 0).
    ``ranks_per_device`` > 1: the ranks share the device under both strategies (on a GPU: the proxy, over gloo)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    comm_rank = int(__import__("os").environ["RANK"])

    class Spiky(TinyGPT):
        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            loss = super().training_step(batch, batch_idx)
            if batch_idx == 1 and comm_rank == 1:
                loss = loss * float("inf")  # an overflow on rank 1 only
            return loss

    class Scales(L.Callback):
        """What a callback logging or tuning the scale reads, and the weights after each step (rank 0)."""

        def __init__(self) -> None:
            self.scales, self.weights = [], []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:  # noqa: ANN001, ANN002
            self.scales.append(trainer.precision_plugin.scaler.get_scale())
            sharded = hasattr(trainer.strategy, "full_state_dict")
            state = trainer.strategy.full_state_dict() if sharded else pl_module.state_dict()  # {} on ranks > 0
            self.weights.append({k: v.detach().clone() for k, v in state.items()})

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
            self.saved = copy.deepcopy(checkpoint["MixedPrecision"])  # where Lightning keeps the scaler's state

    torch.manual_seed(0)
    initial = Spiky()
    report, finals = {}, {}
    per_device = ranks_per_device
    for name in ["ddp", *stages]:
        scaler = torch.amp.GradScaler(accelerator, init_scale=2.0**10)  # low: only the injected overflow overflows
        scales = Scales()
        ddp = RankOrderDDP(ranks_per_device=per_device) if per_device > 1 else "ddp"
        trainer = L.Trainer(
            accelerator=accelerator, devices=2 // per_device,
            strategy=ddp if name == "ddp" else ShardLabStrategy(stage=name, ranks_per_device=per_device),
            plugins=[MixedPrecision("16-mixed", accelerator, scaler=scaler)], max_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, callbacks=[scales],
        )  # fmt: skip
        trainer.fit(copy.deepcopy(initial), OrderedData(token_dataset(12), 2))
        trainer.save_checkpoint(f"{tmp}/{name}.ckpt")
        assert trainer.world_size == 2, (name, trainer.world_size)
        plugin = trainer.precision_plugin
        first, skipped, third = scales.weights
        final = finals[name] = {k: v.float().cpu() for k, v in third.items()}
        report[name] = {
            "from_ddp": _update_gap(final, finals["ddp"], initial.state_dict()),
            "scaler": isinstance(plugin.scaler, torch.amp.GradScaler),
            "scales": scales.scales,
            "saved": scales.saved,
            "skipped": all(torch.equal(first[k], skipped[k]) for k in first),  # step 2 changed nothing
            "trained_after": not all(torch.equal(skipped[k], third[k]) for k in first),  # step 3 trained again
        }
        if name != "ddp":
            report[name]["compute_dtype"] = str(trainer.strategy.sharded.flat_params[0].full.dtype)
    return report


def check_fp16_against_ddp(reports: list[dict]) -> None:
    """Every rank saw DDP's scales and skipped the overflowed step as DDP did; rank 0's weights near DDP's."""
    for rank, report in enumerate(reports):
        ddp = report["ddp"]
        assert ddp["scales"] == [2.0**10, 2.0**9, 2.0**9], ddp
        for stage in (1, 2, 3):
            ours = report[stage]
            assert ours["scaler"] and ours["compute_dtype"] == "torch.float16", stage
            assert ours["scales"] == ddp["scales"] and ours["saved"] == ddp["saved"], (stage, ours, ddp)
            if rank == 0:  # the weights (rank 0 holds the full state dict): step 2 skipped, step 3 taken
                assert ddp["skipped"] and ddp["trained_after"], ddp
                assert ours["skipped"] and ours["trained_after"], stage
                assert ours["from_ddp"] < MIXED_UPDATE_GAP, (stage, ours["from_ddp"])


def test_fp16_loss_scale_overflow_on_one_rank_skips_the_step_everywhere(tmp_path) -> None:  # noqa: ANN001
    kwargs = {"stages": [1, 2, 3], "tmp": str(tmp_path)}
    check_fp16_against_ddp(
        run_ranks("tests.test_mixed_precision:fp16_overflow_skips_on_every_rank", 2, kwargs, timeout=180)
    )
