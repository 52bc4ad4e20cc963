"""Local training and evaluation, identical for every method: SGD, mini-batches, cross-entropy (a
regression task: squared error, and RMSE for its score)."""

from __future__ import annotations

import ctypes
import functools
import math
import secrets
import sys
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.optim.sgd import sgd

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.model.device import pick_device

if TYPE_CHECKING:
    from fedcond.privacy.dp import PrivacyLedger

EVAL_BATCH = 1024


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    batch_size: int
    learning_rate: float
    momentum: float
    channels_last: bool = False
    #: A regression task (``DatasetSpec.regression``): squared error on the one output, RMSE its score.
    regression: bool = False

    @classmethod
    def of(cls, config: RunConfig) -> TrainSettings:
        """A run's local training settings (``config`` resolved: dataset defaults filled in)."""
        from fedcond.data.datasets import dataset_spec

        return cls(
            config.local_epochs, config.batch_size, config.learning_rate, config.momentum, config.uses_channels_last,
            dataset_spec(config.dataset).regression,
        )  # fmt: skip


def task_loss(outputs: torch.Tensor, targets: torch.Tensor, regression: bool, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the logits, or a regression task's squared error of its one output."""
    if regression:
        return nn.functional.mse_loss(outputs.squeeze(1), targets, reduction=reduction)
    return nn.functional.cross_entropy(outputs, targets, reduction=reduction)


def set_layout(model: nn.Module, channels_last: bool) -> None:
    """The memory format of the model's convolution weights: channels-last or the default. Set both
    ways on every use, so that a model reused within a process never keeps another run's layout
    (the layout changes the kernels' rounding)."""
    model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def laid_out(images: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A batch of images (N, C, H, W) in the layout ``set_layout`` gave the model."""
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images


class LocalTerm:
    """What a method adds to its clients' local steps beyond the task's loss (FedProx's and Ditto's
    pull, SCAFFOLD's correction). It reads the model and fixed tensors, never a sample, so under
    DP-SGD its gradient goes in after the clipping and the noise and costs no privacy."""

    def penalty(self, model: nn.Module) -> torch.Tensor | None:
        """A term of the local objective, added to the task's loss (and to the loss reported) where
        the loss is differentiated as a whole (plain SGD); None: the objective is the task's."""
        return None

    def add_gradient(self, model: nn.Module, with_penalty: bool) -> None:
        """Called after each step's gradient is in, before the step: adds what the loss did not
        carry, that is the penalty's gradient ``with_penalty`` (DP-SGD, whose per-sample clipping
        must not see it) and any change of direction that is no term of the objective."""

    def to(self, device: torch.device) -> None:
        """Moves the tensors it holds to the model's device."""


@dataclass(frozen=True)
class ProximalTerm(LocalTerm):
    """Adds (strength / 2) * ||w - anchor||^2 to the task loss (FedProx's and Ditto's pull)."""

    anchor: nn.Module
    strength: float

    def penalty(self, model: nn.Module) -> torch.Tensor:
        squared = [
            (own - fixed.detach()).pow(2).sum()
            for own, fixed in zip(model.parameters(), self.anchor.parameters(), strict=True)
        ]
        return 0.5 * self.strength * torch.stack(squared).sum()

    @torch.no_grad()
    def add_gradient(self, model: nn.Module, with_penalty: bool) -> None:
        if with_penalty:
            for own, fixed in zip(model.parameters(), self.anchor.parameters(), strict=True):
                own.grad.add_(own - fixed, alpha=self.strength)  # type: ignore[union-attr]

    def to(self, device: torch.device) -> None:
        self.anchor.to(device)


@dataclass(frozen=True)
class EvalResult:
    loss: float
    #: The task's score: accuracy, or a regression task's RMSE (``DatasetSpec.metric``).
    accuracy: float
    num_samples: int
    #: Correct predictions per class (classification; ``fedcond.records.metrics.PER_CLASS_ACCURACY``).
    class_correct: np.ndarray | None = None


#: glibc's mmap threshold and trim threshold while training: what glibc sets on its own once a
#: 32 MB block has been freed (it raises both after large frees, up to this size).
MALLOC_MMAP_THRESHOLD = 32 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


@functools.cache
def reuse_freed_buffers() -> None:
    """Let a training process reuse its freed activation buffers instead of faulting fresh pages in.

    Under glibc's start-up setting every freed block over 128 KB goes back to the OS, and a CNN's
    activations and gradients (a few MB each) are mapped and page-faulted anew on every operation:
    on 2 cores the MNIST client's ReLUs took 3x as long and a round 25% longer. A process that had
    decoded a dataset (and freed its temporaries) got glibc's own raised threshold by accident; one
    that maps the decoded copy (``fedcond.data.datasets``) must ask. No number changes: only where the
    memory comes from. Elsewhere than glibc Linux this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * MALLOC_MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc (musl, ...): its allocator's own behaviour stays
        pass


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _condition_tensor(condition: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """One fingerprint (d,) as a (1, d) row broadcast to every sample, or per-sample rows (n, d) as they are."""
    if condition is None:
        return None
    rows = condition.astype(np.float32)
    return _tensor(rows[None, :] if rows.ndim == 1 else rows, device)


class MomentumSGD:
    """The paper's optimiser, SGD with momentum (plain SGD when ``momentum`` is 0): PyTorch's own
    update, ``torch.optim.sgd.sgd`` (the functional form ``torch.optim.SGD.step`` calls, with the
    same defaults: no dampening, weight decay or Nesterov), so the same numbers bit for bit
    (tests/test_training.py), on the CPU and on CUDA alike.

    Not ``torch.optim.SGD`` itself because every ``torch.optim.Optimizer`` imports ``torch._dynamo``
    on first use (its ``__init__`` and ``step`` are wrapped by ``torch._disable_dynamo``): ~1.3 CPU
    seconds, which a deployed ClientApp, a new process per message in Flower 1.42, paid on every fit
    message on every node. The functional update imports nothing.
    """

    def __init__(self, parameters: Iterable[nn.Parameter], learning_rate: float, momentum: float) -> None:
        self.parameters = list(parameters)
        self.learning_rate = learning_rate
        self.momentum = momentum
        # One buffer per parameter, made from its first gradient, kept across steps (and a pooled
        # run's rounds) like torch's optimiser state.
        self.buffers: list[torch.Tensor | None] = [None] * len(self.parameters)

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None  # torch's default (set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        indices = [index for index, parameter in enumerate(self.parameters) if parameter.grad is not None]
        buffers = [self.buffers[index] for index in indices]
        sgd(
            [self.parameters[index] for index in indices],
            [self.parameters[index].grad for index in indices],  # type: ignore[misc]
            buffers,
            weight_decay=0.0,
            momentum=self.momentum,
            lr=self.learning_rate,
            dampening=0.0,
            nesterov=False,
            maximize=False,
        )
        if self.momentum != 0:  # sgd fills the list with the buffers it created on a first step
            for index, buffer in zip(indices, buffers, strict=True):
                self.buffers[index] = buffer

    def state_dict(self) -> dict[str, object]:
        """The momentum buffers (a pooled run's checkpoint keeps them across a resume)."""
        return {"momentum_buffers": [None if b is None else b.detach().clone() for b in self.buffers]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        buffers = list(state["momentum_buffers"])  # type: ignore[call-overload]
        if len(buffers) != len(self.parameters):
            raise ValueError(f"optimiser state for {len(buffers)} parameters, the model has {len(self.parameters)}")
        self.buffers = [None if b is None else b.to(p.device) for b, p in zip(buffers, self.parameters, strict=True)]


def new_optimiser(model: nn.Module, settings: TrainSettings) -> MomentumSGD:
    """The paper's optimiser: SGD with momentum (plain SGD when ``momentum`` is 0)."""
    return MomentumSGD(model.parameters(), settings.learning_rate, settings.momentum)


def torch_optimiser(model: nn.Module, settings: TrainSettings) -> torch.optim.SGD:
    """The same optimiser as ``torch.optim.SGD``, for Opacus: its ``DPOptimizer`` wraps a
    ``torch.optim.Optimizer`` (param_groups, state). DP-SGD imports Opacus, and with it torch._dynamo,
    anyway, so ``MomentumSGD``'s saving does not apply there."""
    return torch.optim.SGD(model.parameters(), lr=settings.learning_rate, momentum=settings.momentum)


def train(
    model: nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    condition: np.ndarray | None,
    settings: TrainSettings,
    seed: int,
    term: LocalTerm | None = None,
) -> float:
    """Train in place for ``settings.epochs`` with a fresh optimiser; return the last epoch's mean loss.

    With ``term``, each step also takes the method's local term (``LocalTerm``; its penalty is in
    the reported loss too).
    ``condition`` is the client's fingerprint (d,) or, for pooled data, one row per sample (n, d).

    The batch order comes from ``seed`` alone, so a client's update does not depend on which Ray
    actor runs it or in which order: the same seed gives the same numbers.
    """
    device = pick_device()
    model.to(device)
    if term is not None:
        term.to(device)
    return run_epochs(
        model,
        new_optimiser(model, settings),
        (_tensor(images, device), _tensor(labels, device), _condition_tensor(condition, device)),
        settings,
        torch.Generator().manual_seed(seed),
        term,
    )


def run_epochs(
    model: nn.Module,
    optimiser: MomentumSGD,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    settings: TrainSettings,
    generator: torch.Generator,
    term: LocalTerm | None = None,
) -> float:
    """``settings.epochs`` epochs of mini-batch SGD over ``data`` = (images, labels, conditions) on the
    model's device, continuing ``optimiser`` (momentum) and ``generator`` (batch order) as they are:
    a pooled run keeps both across epochs, a federated client starts both afresh every round."""
    reuse_freed_buffers()
    x, y, cond = data
    # One row is the client's own fingerprint for every sample; more rows are per sample (pooled data).
    per_sample = cond is not None and len(cond) > 1
    device = x.device
    set_layout(model, settings.channels_last)
    model.train()
    epoch_loss = math.nan
    for _ in range(settings.epochs):
        order = torch.randperm(len(x), generator=generator).to(device)
        total, seen = 0.0, 0
        for start in range(0, len(x), settings.batch_size):
            batch = order[start : start + settings.batch_size]
            optimiser.zero_grad()
            batch_cond = cond[batch] if per_sample else cond
            loss = task_loss(
                model(laid_out(x[batch], settings.channels_last), batch_cond), y[batch], settings.regression
            )
            penalty = term.penalty(model) if term is not None else None
            if penalty is not None:
                loss = loss + penalty
            if not torch.isfinite(loss):
                raise FedcondError(
                    f"training loss became {loss.item()}; lower learning-rate (now {settings.learning_rate})"
                )
            loss.backward()
            if term is not None:
                term.add_gradient(model, with_penalty=False)
            optimiser.step()
            total += loss.item() * len(batch)
            seen += len(batch)
        epoch_loss = total / max(seen, 1)
    return epoch_loss


@dataclass(frozen=True)
class DpSgd:
    """DP-SGD's two settings: every sample's gradient clipped to ``max_grad_norm`` (L2), then Gaussian
    noise of std ``noise_multiplier * max_grad_norm`` added to each batch's sum."""

    noise_multiplier: float
    max_grad_norm: float


def train_private(
    model: nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    condition: np.ndarray | None,
    settings: TrainSettings,
    dp_sgd: DpSgd,
    ledger: PrivacyLedger,
    term: LocalTerm | None = None,
) -> float:
    """``train`` with DP-SGD through Opacus: Poisson-sampled batches (each sample joins each step with
    probability batch-size / n, the sampling Opacus's accountant assumes), per-sample clipping and
    Gaussian noise; the steps are added to ``ledger``. Returns the last epoch's mean loss, which is
    not private: the client keeps it.

    ``condition`` is one fingerprint row (d,) (the client's, already DP when it depends on the data).
    The batches and the noise come from the operating system's entropy, not from a seed: whoever
    knows the run's seed could otherwise undo them, so DP runs are not bit-reproducible. A local
    term (``LocalTerm``) does not depend on the data: its gradient is added after the noise.
    """
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from fedcond.privacy.dp import per_sample_gradient_layers

    per_sample_gradient_layers()  # registers fedcond's own layers with Opacus
    device = pick_device()
    model.to(device).train()  # before Opacus checks the model (a reused model may come from evaluation)
    set_layout(model, settings.channels_last)
    if term is not None:
        term.to(device)
    x, y, cond = _tensor(images, device), _tensor(labels, device), _condition_tensor(condition, device)
    sampling = torch.Generator().manual_seed(secrets.randbits(63))
    loader = DataLoader(TensorDataset(x, y), batch_size=settings.batch_size, generator=sampling)
    with warnings.catch_warnings():
        # Opacus's secure_mode needs torchcsprng; the generators here are seeded from the OS instead
        # (docs/privacy.md says what that leaves open).
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="rdp")
    hooks, optimiser, private_loader = engine.make_private(
        module=model, optimizer=torch_optimiser(model, settings), data_loader=loader,
        noise_multiplier=dp_sgd.noise_multiplier, max_grad_norm=dp_sgd.max_grad_norm,
        noise_generator=torch.Generator(device=device).manual_seed(secrets.randbits(63)), wrap_model=False,
    )  # fmt: skip
    try:
        with warnings.catch_warnings():
            # The first convolution's input needs no gradient: PyTorch notes that about Opacus's hooks.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            epoch_loss = _private_epochs(model, optimiser, private_loader, cond, settings, term)
    finally:
        # The model may be reused for plain evaluation or training in this process: no hooks, and
        # none of the last batch's inputs or sums Opacus leaves on modules and parameters.
        hooks.cleanup()
        for module in model.modules():
            module.__dict__.pop("activations", None)
        for parameter in model.parameters():
            parameter.__dict__.pop("summed_grad", None)
    for noise_multiplier, sample_rate, steps in engine.accountant.history:
        ledger.add(noise_multiplier, sample_rate, steps)
    return epoch_loss


def _private_epochs(
    model: nn.Module,
    optimiser: torch.optim.Optimizer,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    cond: torch.Tensor | None,
    settings: TrainSettings,
    term: LocalTerm | None,
) -> float:
    """The epochs of ``train_private`` (``optimiser`` is Opacus's DPOptimizer); the last epoch's mean loss."""
    reuse_freed_buffers()
    epoch_loss = math.nan
    for _ in range(settings.epochs):
        total, seen = 0.0, 0
        for batch_x, batch_y in loader:
            optimiser.zero_grad()
            logits = model(laid_out(batch_x, settings.channels_last), cond)
            # Poisson sampling can draw an empty batch: its step still adds the noise the accountant counts.
            loss = task_loss(logits, batch_y, settings.regression) if len(batch_y) else logits.sum() * 0.0
            if not torch.isfinite(loss):
                raise FedcondError(
                    f"training loss became {loss.item()}; lower learning-rate (now {settings.learning_rate})"
                )
            loss.backward()
            if term is None:
                optimiser.step()
            elif optimiser.pre_step():  # type: ignore[attr-defined]  # clipped, noised, scaled
                term.add_gradient(model, with_penalty=True)  # then the data-free term, and the plain SGD step
                optimiser.original_optimizer.step()  # type: ignore[attr-defined]
            total += loss.item() * len(batch_y)
            seen += len(batch_y)
        epoch_loss = total / max(seen, 1)
    return epoch_loss


# no_grad, not inference_mode: a model moved to CUDA inside inference_mode gets inference tensors as
# parameters, and a model reused across messages (fedcond/federation/client.py) could then never train again.
@torch.no_grad()
def evaluate(
    model: nn.Module,
    images: np.ndarray,
    labels: np.ndarray,
    condition: np.ndarray | None,
    channels_last: bool = False,
    regression: bool = False,
) -> EvalResult:
    """Mean cross-entropy and accuracy on ``images`` (a regression task: mean squared error and RMSE);
    never changes the model's parameters (only, with ``set_layout``, their memory format: the run's
    ``channels-last``)."""
    reuse_freed_buffers()
    device = pick_device()
    model.to(device).eval()
    set_layout(model, channels_last)
    cond = _condition_tensor(condition, device)
    total_loss, correct, class_correct = 0.0, 0, None
    for start in range(0, len(images), EVAL_BATCH):
        x = laid_out(_tensor(images[start : start + EVAL_BATCH], device), channels_last)
        y = _tensor(labels[start : start + EVAL_BATCH], device)
        logits = model(x, cond)
        total_loss += task_loss(logits, y, regression, reduction="sum").item()
        if not regression:
            right = logits.argmax(dim=1) == y
            correct += int(right.sum().item())
            hits = torch.bincount(y[right], minlength=logits.shape[1]).cpu().numpy()
            class_correct = hits if class_correct is None else class_correct + hits
    count = len(images)
    mean_loss = total_loss / count
    return EvalResult(mean_loss, math.sqrt(mean_loss) if regression else correct / count, count, class_correct)


#: A round whose mean training loss is this many times chance's (ln of the classes) has diverged.
DIVERGED_OVER_CHANCE = 100.0
#: A regression task has no chance level: this many times its first round's mean training loss.
DIVERGED_OVER_FIRST = 1e4


def check_not_diverged(server_round: int, train_loss: float, num_classes: int, first_loss: float, fix: str) -> None:
    """Stop the run, in one line naming the setting to change, when round ``server_round``'s mean
    training loss has exploded: finite (an infinite loss fails its client already) but over 100 times
    chance's ln(classes) (a regression task: 10,000 times its first round's, ``first_loss``), where a
    run only sits at chance from then on and would otherwise end "finished". NaN (a loss the clients
    withhold under DP-SGD) says nothing. ``fix``: the setting to change, as the method knows it
    (``lower learning-rate (now 0.01)``)."""
    if not math.isfinite(train_loss):
        return
    if num_classes > 1:
        bound, why = DIVERGED_OVER_CHANCE * math.log(num_classes), f"{DIVERGED_OVER_CHANCE:g} times chance's"
    elif math.isfinite(first_loss) and first_loss > 0:
        bound, why = DIVERGED_OVER_FIRST * first_loss, f"{DIVERGED_OVER_FIRST:g} times round 1's"
    else:
        return
    if train_loss > bound:
        raise FedcondError(
            f"round {server_round}: the mean training loss reached {train_loss:.3g}, over {bound:.3g} ({why}): "
            f"training diverged; {fix}"
        )
