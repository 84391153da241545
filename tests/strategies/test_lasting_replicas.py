"""Replicas built once per run and reused: what changes on the module between steps still reaches them, and
compiled networks train under both strategies."""

from __future__ import annotations

import gc
import types
import warnings
from typing import Any

import pytest
import torch
from strategy_models import Classifier, clone, flat_params, loader, metrics, seeded, trainer
from torch import nn

STRATEGIES = ["parallel_criterion", "dp"]


class Scheduled(Classifier):
    """Changes itself between epochs the ways users do: a rebound attribute, unfreezing, a swapped submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) / self.temperature

    def on_train_epoch_start(self) -> None:
        epoch = self.current_epoch
        self.temperature = 1.0 + epoch  # a scheduler-like attribute change
        self.net[0].weight.requires_grad_(epoch != 1)  # frozen in epoch 1, unfrozen after
        if epoch == 2:
            self.net[1] = nn.ReLU()  # a module replaced between epochs: replicas rebuild


def _fit(module: Any, strategy: str, devices: int, **kwargs: Any) -> Any:
    t = trainer(strategy, devices, max_epochs=3, limit_val_batches=2, **kwargs)
    t.fit(module, loader(10), loader(10, seed=1))
    return t


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_changes_between_steps_reach_the_replicas(strategy):
    base = seeded(Scheduled)
    single, multi = clone(base), clone(base)
    reference = _fit(single, "auto", 1)
    got = _fit(multi, strategy, 3)
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert metrics(got) == pytest.approx(metrics(reference), abs=1e-10)
    replicas = got.strategy.__dict__.get("_replicas")
    assert len(replicas) == 0  # released at teardown


def _threads(strategy: str) -> Any:
    import lightning_mgpu

    cls = (
        lightning_mgpu.ParallelCriterionStrategy
        if strategy == "parallel_criterion"
        else lightning_mgpu.DataParallelStrategy
    )
    return cls(execution_mode="threads")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_threads_mode_with_flat_buffers_follows_changes_between_steps(strategy):
    """Replicas with their own leaf parameters (threads): attribute changes, frozen then unfrozen, a rebuild."""
    base = seeded(Scheduled)
    single, multi = clone(base), clone(base)
    reference = _fit(single, "auto", 1)
    got = _fit(multi, _threads(strategy), 3)
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert metrics(got) == pytest.approx(metrics(reference), abs=1e-10)


class CountsReductions(Classifier):
    """Records how many gradient reductions reached the root before each optimizer step."""

    def on_fit_start(self) -> None:
        self.reductions: list[int] = []
        self._seen = 0

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        done = _REDUCTIONS[0]
        self.reductions.append(done - self._seen)
        self._seen = done


_REDUCTIONS = [0]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_reduces_once_per_optimizer_step_and_equals_one_device(strategy, monkeypatch):
    from lightning_mgpu.parallel import replicas

    original = replicas.ReplicaParameters.reduce

    def counted(self: Any, run_hooks: bool = True) -> None:
        if self.active:
            _REDUCTIONS[0] += 1
        original(self, run_hooks)

    monkeypatch.setattr(replicas.ReplicaParameters, "reduce", counted)
    _REDUCTIONS[0] = 0
    base = seeded(CountsReductions)
    single, multi = clone(base), clone(base)
    kwargs = dict(max_epochs=2, limit_val_batches=0, accumulate_grad_batches=3)
    trainer("auto", 1, **kwargs).fit(single, loader(4, n=28))  # 7 batches: steps after 3, 6 and the last one
    trainer(_threads(strategy), 3, **kwargs).fit(multi, loader(4, n=28))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert multi.reductions == [1] * 6


class ReadsGradients(Classifier):
    """Reads the gradients between backward passes, as gradient-norm loggers and masking hooks do: a hook freezes the
    first layer's first rows, ``on_after_backward`` records every gradient norm."""

    def on_fit_start(self) -> None:
        self.norms: list[float] = []
        self.hook_calls = 0
        mask = torch.ones_like(self.net[0].weight)
        mask[:4] = 0

        def masked(grad: torch.Tensor) -> torch.Tensor:
            self.hook_calls += 1
            return grad * mask

        self.net[0].weight.register_hook(masked)

    def on_after_backward(self) -> None:
        self.norms.append(float(torch.cat([p.grad.flatten() for p in self.parameters()]).norm()))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_hooks_and_on_after_backward_see_what_one_device_sees_in_threads_mode(strategy):
    # Replicas in threads hold their own leaves: the originals' hooks run when the reduction reaches them, and with
    # accumulation every backward pass reduces while something reads the gradients in between.
    base = seeded(ReadsGradients)
    single, multi = clone(base), clone(base)
    kwargs = dict(max_epochs=1, limit_val_batches=0, accumulate_grad_batches=2, enable_progress_bar=True)
    trainer("auto", 1, **kwargs).fit(single, loader(4, n=24))
    trainer(_threads(strategy), 3, **kwargs).fit(multi, loader(4, n=24))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    assert multi.norms == pytest.approx(single.norms, abs=1e-10, rel=0) and len(multi.norms) == 6
    assert multi.hook_calls == single.hook_calls == 6
    assert torch.equal(multi.net[0].weight[:4], base.net[0].weight[:4])  # the hook froze them on every device


class SkipsLastMicroBatch(Classifier):
    """Returns None from the last micro-batch of every accumulation window of 3: the optimizer still steps, on the
    gradients of the window's first two micro-batches (reduced after the skipped one, not lost into the next window)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None if batch_idx % 3 == 2 else super().training_step(batch, batch_idx)


class HookedMidWindow(Classifier):
    """Registers a gradient hook (doubling) on the second micro-batch of the first accumulation window: on one device
    it acts on the later backward passes only."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            self.net[0].weight.register_hook(lambda grad: grad * 2)


class SwapsFrozenLayers(Classifier):
    """Trains the first layer on even micro-batches and the last on odd ones, as ``toggle_optimizer`` swaps a GAN's
    halves: the first layer's gradient from the window's first micro-batch must survive the second."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.net[0].requires_grad_(batch_idx % 2 == 0)
        self.net[2].requires_grad_(batch_idx % 2 == 1)


@pytest.mark.parametrize(
    ("module", "accumulate"), [(SkipsLastMicroBatch, 3), (HookedMidWindow, 2), (SwapsFrozenLayers, 2)]
)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulation_windows_with_a_skipped_step_a_new_hook_or_swapped_frozen_layers_equal_one_device(
    module, accumulate, strategy
):
    """The reduction waits for a window's last backward pass: a skipped last step still reduces the window's
    gradients before the optimizer steps, gradients that waited from before a new hook reach .grad without it, and a
    layer frozen after its backward pass keeps its gradient."""
    base = seeded(module)
    single, multi = clone(base), clone(base)
    kwargs = dict(max_epochs=1, limit_val_batches=0, accumulate_grad_batches=accumulate)
    trainer("auto", 1, **kwargs).fit(single, loader(4, n=36))
    trainer(_threads(strategy), 3, **kwargs).fit(multi, loader(4, n=36))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)


class CountsBuilds(Classifier):
    builds: list[int]

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        self.builds = [r.replica_set.builds for r in strategy._replicas.values()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_replicas_are_built_once_per_run_not_per_step(strategy):
    module = seeded(CountsBuilds)
    _fit(module, strategy, 3)
    # One build for the whole run: 3 epochs of training and validation (train()/eval() only rebinds attributes,
    # which are copied to the replicas).
    assert module.builds == [1]


def test_fit_validate_fit_equals_one_device():
    base = seeded(Classifier)
    single, multi = clone(base), clone(base)
    for module, strategy, devices in ((single, "auto", 1), (multi, "parallel_criterion", 3)):
        trainer(strategy, devices, max_steps=3).fit(module, loader(10))
        trainer(strategy, devices).validate(module, loader(7), verbose=False)
        trainer(strategy, devices, max_steps=6).fit(module, loader(10))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)


def test_no_growth_in_objects_over_steps():
    module = seeded(Classifier)

    class Count:
        def __init__(self) -> None:
            self.counts: list[int] = []

    counter = Count()

    from lightning.pytorch.callbacks import Callback

    class Objects(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step in (20, 120):
                gc.collect()
                counter.counts.append(len(gc.get_objects()))

    trainer("parallel_criterion", 3, max_steps=120, callbacks=[Objects()]).fit(module, loader(4, n=400))
    early, late = counter.counts
    assert late - early < 200, counter.counts  # steady state: no per-step growth (100 steps apart)


class Compiled(Classifier):
    def __init__(self, backend: str) -> None:
        super().__init__()
        self.net = Net()
        self.net.compile(backend=backend)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Eager(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()


@pytest.mark.parametrize(("strategy", "backend"), [("parallel_criterion", "inductor"), ("dp", "aot_eager")])
def test_compiled_network_trains_as_the_eager_one_device_run(strategy, backend):
    """``net.compile()`` under both strategies: each lasting replica runs compiled code bound to its own tensors."""
    torch.manual_seed(0)
    eager = Eager().float()
    compiled = Compiled(backend).float()
    compiled.load_state_dict(eager.state_dict())
    kwargs = dict(max_steps=4, limit_val_batches=0)
    trainer("auto", 1, **kwargs).fit(eager, loader(10, dtype=torch.float32))
    trainer(strategy, 3, **kwargs).fit(compiled, loader(10, dtype=torch.float32))
    torch.testing.assert_close(flat_params(compiled), flat_params(eager), rtol=1e-5, atol=1e-5)
    assert compiled.net._compiled_call_impl is not None  # still compiled, state-dict keys unchanged
    assert set(compiled.state_dict()) == set(eager.state_dict())


class AnnealedTemperature(Classifier):
    """A buffer (annealed in place each epoch) that Lightning's EMAWeightAveraging averages and swaps in for validation
    through ``.data``, which moves no version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("temperature", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) / self.temperature

    def on_train_epoch_start(self) -> None:
        with torch.no_grad():
            self.temperature.mul_(0.5)


@pytest.mark.parametrize(
    "strategy", ["parallel_criterion", "dp", "threads"], ids=["parallel_criterion", "dp", "parallel_criterion-threads"]
)
def test_weights_swapped_in_by_lightnings_ema_callback_reach_the_replicas(strategy):
    from lightning.pytorch.callbacks import Callback, EMAWeightAveraging

    class ValidationLosses(Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            self.losses.append(float(trainer.callback_metrics["val_loss"]))

    base = seeded(AnnealedTemperature)
    runs = []
    for module, chosen, devices in ((clone(base), "auto", 1), (clone(base), strategy, 2)):
        chosen = _threads("parallel_criterion") if chosen == "threads" else chosen
        losses = ValidationLosses()
        t = trainer(chosen, devices, max_epochs=2, enable_progress_bar=True)
        t.callbacks.extend([EMAWeightAveraging(decay=0.5), losses])
        t.fit(module, loader(10), loader(10, seed=1))
        runs.append((losses.losses, flat_params(module)))
    (single_losses, single_params), (losses, params) = runs
    assert len(losses) == 2 and losses == pytest.approx(single_losses, abs=1e-12)
    torch.testing.assert_close(params, single_params, rtol=0, atol=1e-12)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp", "threads"])
def test_lightnings_model_pruning_prunes_as_on_one_device(strategy):
    """torch's pruning sets each pruned module's ``weight`` in a forward pre-hook, which runs on the replicas; the
    next pruning call ranks the weights by that attribute of your module, so it must hold what one device's forward
    left there."""
    from lightning.pytorch.callbacks import ModelPruning

    base = seeded(Classifier)
    states = []
    for module, chosen, devices in ((clone(base), "auto", 1), (clone(base), strategy, 3)):
        chosen = _threads("parallel_criterion") if chosen == "threads" else chosen
        t = trainer(chosen, devices, max_epochs=4, enable_progress_bar=True)
        t.callbacks.append(ModelPruning("l1_unstructured", amount=0.25, make_pruning_permanent=False, verbose=0))
        t.fit(module, loader(10), loader(10, seed=1))
        states.append({k: v.detach().clone() for k, v in module.state_dict().items() if k.endswith(("_orig", "_mask"))})
    assert states[0].keys() == states[1].keys() and len(states[0]) == 8  # weight and bias of two layers
    for key in states[0]:
        torch.testing.assert_close(states[1][key], states[0][key], rtol=0, atol=1e-12)


class Reparametrized(Classifier):
    """torch's hook-based ``weight_norm`` and ``spectral_norm`` (a forward pre-hook sets ``weight``; spectral norm's
    power iteration updates buffers), and ``forward`` replaced on submodules between epochs: a bound method, then a
    closure."""

    def configure_model(self) -> None:  # not in __init__: a module with weight_norm's computed weight cannot be copied
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of parametrizations, still used
            nn.utils.weight_norm(self.net[0])
        torch.manual_seed(0)  # spectral norm's random start vectors
        nn.utils.spectral_norm(self.net[2])

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            halved = lambda layer, x: nn.functional.linear(x, layer.weight * 0.5, layer.bias)  # noqa: E731
            self.net[2].forward = types.MethodType(halved, self.net[2])
        if self.current_epoch == 2:
            self.net[1].forward = lambda x: torch.tanh(2 * x)


@pytest.mark.parametrize("strategy", ["parallel_criterion", "dp", "threads"])
def test_hook_set_weights_and_replaced_forwards_are_as_on_one_device(strategy):
    """Parameters, spectral norm's buffers, logged metrics and the hook-set ``weight`` attributes (what a callback
    reads) equal one device's after each forward change."""
    base = seeded(Reparametrized)
    single, multi = clone(base), clone(base)
    reference = _fit(single, "auto", 1)
    got = _fit(multi, _threads("parallel_criterion") if strategy == "threads" else strategy, 3)
    for a, b in zip(multi.state_dict().values(), single.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for k in (0, 2):
        torch.testing.assert_close(multi.net[k].weight, single.net[k].weight, rtol=0, atol=1e-10)
    assert metrics(got) == pytest.approx(metrics(reference), abs=1e-10)


class NewBody(Classifier):
    """Replaces ``self.net`` with a new network at epoch 1 (rebuilding the optimizer), recording the batch sizes the
    new one's forward sees."""

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            torch.manual_seed(3)
            self.net = nn.Sequential(nn.Linear(self.net[0].in_features, 8), nn.Tanh(), nn.Linear(8, 3)).to(self.dtype)
            self.seen: list[int] = []
            self.net.register_forward_pre_hook(lambda module, args: self.seen.append(len(args[0])))
            self.trainer.strategy.setup_optimizers(self.trainer)


def test_dp_runs_a_replaced_parallel_module_replicated(recwarn):
    """``DataParallelStrategy(parallel_modules=["net"])`` and ``self.net = ...`` between epochs: the new network runs
    replicated on shards 4/3/3 as the old one did, equal to one device, without a warning."""
    import lightning_mgpu

    base = seeded(NewBody)
    single, multi = clone(base), clone(base)
    _fit(single, "auto", 1)
    _fit(multi, lightning_mgpu.DataParallelStrategy(parallel_modules=["net"]), 3)
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    # The hook sees the whole batch on the module called, then each shard on the replicas that share its hooks.
    assert single.seen[:2] == [10, 10] and multi.seen[:8] == [10, 4, 3, 3, 10, 4, 3, 3]
    assert not [w for w in recwarn if "replicated forward" in str(w.message)]


class TripledForward(Classifier):
    """Replaces the ``forward`` of ``self.net`` (or of the module itself) on the instance at epoch 1."""

    def __init__(self, target: str = "net") -> None:
        super().__init__()
        self.target = target

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            module = self.get_submodule(self.target)
            tripled = lambda m, x: type(m).forward(m, x) * 3.0  # noqa: E731
            module.forward = types.MethodType(tripled, module)


@pytest.mark.parametrize("target", ["net", ""])
def test_dp_runs_a_forward_replaced_on_its_parallel_module_replicated(target):
    """``dp``'s replicated forward wraps the one you set on the instance (it did replace it: 0.78 off): equal to one
    device, and the module gets your forward back after fit."""
    import lightning_mgpu

    base = seeded(TripledForward, target=target)
    single, multi = clone(base), clone(base)
    _fit(single, "auto", 1)
    _fit(multi, lightning_mgpu.DataParallelStrategy(parallel_modules=[target]), 3)
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-10)
    restored = multi.get_submodule(target).__dict__["forward"]
    assert isinstance(restored, types.MethodType) and restored.__self__ is multi.get_submodule(target)


class BackwardIntoOnePart(Classifier):
    """Manual optimization that backpropagates into the second layer only (``inputs=``), as GAN steps do."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self(x), y), inputs=list(self.net[2].parameters()))
        optimizer.step()


def test_manual_backward_with_inputs_reaches_the_parameters_named_in_threads_mode():
    """In threads mode the replicas hold leaves of their own, which the graph reaches instead of the parameters that
    ``inputs=`` names: the strategy names the leaves, and the gradients reach the parameters by the reduction."""
    base = seeded(BackwardIntoOnePart)
    single, multi = clone(base), clone(base)
    trainer("auto", 1, max_epochs=2, enable_progress_bar=True).fit(single, loader(10))
    trainer(_threads("dp"), 3, max_epochs=2, enable_progress_bar=True).fit(multi, loader(10))
    torch.testing.assert_close(flat_params(multi), flat_params(single), rtol=0, atol=1e-12)
    assert not torch.equal(flat_params(single), flat_params(base))  # it trained
