"""What the benchmark scripts share: launching their jobs, small statistics, the model, data and Trainer.

Every benchmark is one script that plays two roles: run without ``--worker`` it is the driver
(it launches jobs, gathers what each rank wrote and prints tables); run with ``--worker`` it is
one training process. Workers write ``rank<N>.json`` into the ``--out`` folder they are given.
The scripts import only this package, so each runs as ``python benchmarks/<name>.py`` and as
``python -m benchmarks.<name>`` alike.
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from hvd_plugins.testing import launch
from hvd_plugins.testing.launch import JobResult

TWO_EMULATED_NODES = "localhost:2,127.0.0.1:2"
"""Two hosts that name this machine twice: Horovod sees 2 nodes of 2 workers."""


# ---------------------------------------------------------------------------------------- launching
def horovodrun(
    script_args: Sequence[str],
    out_dir: Path,
    np: int = 2,
    hosts: str | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> JobResult:
    """``horovodrun -np N -H hosts --gloo python <script_args> --out out_dir``."""
    return launch.horovodrun(
        [sys.executable, *script_args], np=np, hosts=hosts, out_dir=out_dir, timeout=timeout, env=env
    )


def torchrun(script_args: Sequence[str], out_dir: Path, nproc: int = 2, timeout: float = 300) -> JobResult:
    """``python -m torch.distributed.run --nproc_per_node N <script_args> --out out_dir`` (one node)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command += [*script_args, "--out", str(out_dir)]
    return launch.run_bounded(command, timeout, out_dir=out_dir)


def daso_settings(compression: str, warmup_epochs: int, cooldown_epochs: int) -> dict[str, Any]:
    """DASO knobs for a benchmark row whose compression column also picks the cross-node wire type.

    ``"fp16"`` and ``"bf16"`` send the parameters as float16 and bfloat16, ``"none"`` as float32, so a row's
    bytes follow its label.
    """
    downcast = compression if compression in ("fp16", "bf16") else "fp32"
    return {"warmup_epochs": warmup_epochs, "cooldown_epochs": cooldown_epochs, "downcast": downcast}


# ---------------------------------------------------------------------------------------- numbers
def median(values: Sequence[float]) -> float:
    """The median as a float; raises on no values (a benchmark row without a measurement is a bug)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def steps_per_second(step_end_times: Sequence[float], warmup_steps: int) -> float:
    """Rate over the steps after the first ``warmup_steps`` (startup and first steps excluded)."""
    if len(step_end_times) < warmup_steps + 2:
        raise ValueError(f"need more than {warmup_steps + 1} timed steps, got {len(step_end_times)}")
    timed = step_end_times[warmup_steps:]
    return (len(timed) - 1) / (timed[-1] - timed[0])


def thread_cpu_seconds() -> dict[int, float]:
    """CPU seconds of every thread of this process, by thread id: the scheduler's nanoseconds on a CPU
    (Linux ``/proc/.../schedstat``), else user + system time in clock ticks (``stat``, 10 ms steps)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path(f"/proc/self/task/{tid}")
        try:
            try:
                seconds[int(tid)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            except FileNotFoundError:  # a kernel without scheduler statistics
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except OSError:  # the thread ended between the listing and the read
            continue
    return seconds


CPU_ROLES = ("cpu_main_ms", "cpu_busiest_ms", "cpu_rest_ms")
"""The keys of ``cpu_by_role``: the main (training) thread, the busiest other thread (for a distributed worker,
one of its communication threads: negotiation, Gloo's ring and transport) and all other threads together."""


def cpu_by_role(start: dict[int, float], end: dict[int, float], steps: int) -> dict[str, float]:
    """Milliseconds of CPU per step between two ``thread_cpu_seconds`` readings, by ``CPU_ROLES``."""
    used = {tid: end[tid] - start.get(tid, 0.0) for tid in end}
    main = used.pop(os.getpid(), 0.0)
    busiest = max(used.values(), default=0.0)
    rest = sum(used.values()) - busiest
    per_step = 1000 / steps
    return dict(zip(CPU_ROLES, (main * per_step, busiest * per_step, rest * per_step), strict=True))


def target_verdict(measured: float, target: float, higher_is_better: bool = True) -> str:
    """``met`` or ``not met``: the word a report prints next to a target."""
    met = measured >= target if higher_is_better else measured <= target
    return "met" if met else "not met"


# ---------------------------------------------------------------------------------------- models and data
def mlp(in_features: int, hidden: Sequence[int], classes: int, seed: int = 0) -> nn.Sequential:
    """A plain ReLU MLP initialised from ``seed``, so every worker and variant starts from the same weights.

    Its parameter count grows with ``hidden``, so communication can be made to matter.
    """
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class SyntheticTaskModule(pl.LightningModule):
    """What the benchmarks' LightningModules share: cross-entropy of ``self(inputs)`` against ``labels``.

    ``forward`` returns logits whose last dimension is the classes (or the vocabulary), for one label
    per sample (a classifier) or per position (a language model); ``loss`` and ``accuracy`` flatten
    both alike, so a driver or a hand-written loop uses every model the same way.
    """

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        return self.loss(inputs, labels)

    @torch.no_grad()
    def accuracy(self, dataset: torch.utils.data.TensorDataset, batch_size: int = 128) -> float:
        """Share of labels (samples, or tokens) the argmax of the logits gets right, in eval mode."""
        was_training = self.training
        self.eval()
        inputs, labels = dataset.tensors
        right = sum(
            int((self(inputs[i : i + batch_size]).argmax(dim=-1) == labels[i : i + batch_size]).sum())
            for i in range(0, len(inputs), batch_size)
        )
        self.train(was_training)
        return right / labels.numel()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """One optimizer, so a hand-written loop can wrap it with ``hvd.DistributedOptimizer`` as the strategy does."""
        raise NotImplementedError


class Classifier(SyntheticTaskModule):
    """The benchmarks' MLP module: an ``mlp`` trained with cross-entropy and SGD."""

    def __init__(self, features: int, hidden: Sequence[int], classes: int, lr: float, momentum: float = 0.0) -> None:
        super().__init__()
        self.net = mlp(features, hidden, classes)
        self.lr, self.momentum = lr, momentum

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention over earlier positions only, with separate query, key, value and output layers."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} must split evenly over {heads} heads")
        self.heads = heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, length, head width)
            return t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)

        mixed = F.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), is_causal=True
        )
        return self.out(mixed.transpose(1, 2).reshape(batch, length, width))


class TransformerBlock(nn.Module):
    """A pre-LayerNorm decoder block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TiedGPT(nn.Module):
    """Token and position embeddings, a ``ModuleList`` of ``TransformerBlock`` (the default units of
    ``shard="parameters"``), a final norm, and a head tied to the token embedding: pythia's layout."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TransformerLM(SyntheticTaskModule):
    """A decoder-only Transformer language model trained on next-token cross-entropy with AdamW.

    Token and learned position embeddings, ``layers`` pre-LayerNorm blocks, a final LayerNorm and an
    output projection that shares its weight with the token embedding (``lm_head.weight is
    embedding.weight``). Inputs are token ids ``(batch, length)`` with ``length <= context``; the
    logits are ``(batch, length, vocab)``. The defaults have 2.7 M parameters in 260 tensors.
    """

    def __init__(
        self,
        vocab: int = 2048,
        d_model: int = 112,
        layers: int = 16,
        heads: int = 4,
        context: int = 64,
        lr: float = 1e-3,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.lr, self.context = lr, context
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embedding = nn.Embedding(vocab, d_model)
            self.position = nn.Embedding(context, d_model)
            self.blocks = nn.ModuleList(TransformerBlock(d_model, heads) for _ in range(layers))
            self.norm = nn.LayerNorm(d_model)
            self.lm_head = nn.Linear(d_model, vocab, bias=False)
            self.lm_head.weight = self.embedding.weight  # tied: one tensor, one gradient to sync
            for name, parameter in self.named_parameters():
                if name.endswith("weight") and parameter.dim() == 2:  # N(0, 0.02), as GPT-2
                    nn.init.normal_(parameter, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.size(1) > self.context:
            raise ValueError(f"sequence of {tokens.size(1)} tokens is longer than the context {self.context}")
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embedding(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, a 1x1 projection where the shape changes."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResidualConvNet(SyntheticTaskModule):
    """A small ResNet classifier with BatchNorm2d, trained with cross-entropy and SGD with momentum.

    A 3x3 stem, then one stage per entry of ``channels`` (``blocks`` basic blocks each; every stage
    after the first halves the resolution), global average pooling and a linear layer. Inputs are
    ``(batch, 3, H, W)`` images. ``Trainer(sync_batchnorm=True)`` swaps its BatchNorm layers for the
    strategy's. The defaults have 0.17 M parameters in 47 tensors.
    """

    def __init__(
        self,
        channels: Sequence[int] = (16, 32, 64),
        blocks: int = 2,
        classes: int = 10,
        lr: float = 0.05,
        momentum: float = 0.9,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.lr, self.momentum = lr, momentum
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.stem = nn.Sequential(
                nn.Conv2d(3, channels[0], 3, padding=1, bias=False), nn.BatchNorm2d(channels[0]), nn.ReLU()
            )
            stages: list[nn.Module] = []
            width = channels[0]
            for index, size in enumerate(channels):
                for block in range(blocks):
                    stages.append(BasicBlock(width, size, stride=2 if index > 0 and block == 0 else 1))
                    width = size
            self.stages = nn.Sequential(*stages)
            self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(images))
        return self.head(features.mean(dim=(2, 3)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=5e-4)


class StepClock(pl.Callback):
    """When each training batch ended, in seconds since training started, and with ``losses`` its loss."""

    def __init__(self, losses: bool = False) -> None:
        self.record_losses = losses
        self.times: list[float] = []
        self.losses: list[float] = []
        self.total = 0.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *rest: Any) -> None:
        self.times.append(time.perf_counter() - self.start)
        if self.record_losses:
            self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.total = time.perf_counter() - self.start


def cpu_trainer(
    strategy: Any,
    callbacks: Sequence[pl.Callback],
    devices: int = 1,
    max_epochs: int = 1,
    sync_batchnorm: bool = False,
) -> pl.Trainer:
    """A Trainer on CPU that only trains: no logger, checkpoints, progress bar, summary or validation."""
    return pl.Trainer(
        sync_batchnorm=sync_batchnorm,
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=list(callbacks),
    )


def parameter_count(model: nn.Module) -> int:
    """Trainable parameters: what a gradient sync moves."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def random_classification(samples: int, features: int, classes: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Synthetic inputs and labels, identical on every worker (same seed)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(inputs, labels)


def markov_tokens(
    samples: int, vocab: int, context: int, seed: int = 0, successors: int = 4
) -> torch.utils.data.TensorDataset:
    """Token sequences from a random first-order Markov chain, identical for the same arguments.

    Each token may be followed by ``successors`` tokens only, drawn with Zipf weights over the
    vocabulary (so a few tokens are frequent) and taken with probabilities 8:4:2:1... A model first
    learns the frequent tokens (the loss falls fast from ``ln(vocab)``), then the transitions (it
    falls slowly towards the chain's entropy, about 1.1 nats for 4 successors). Inputs are the
    first ``context`` tokens of a sequence, labels the ``context`` tokens after them.
    """
    generator = torch.Generator().manual_seed(seed)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    zipf = zipf[torch.randperm(vocab, generator=generator)]  # which tokens are frequent is random too
    table = torch.multinomial(zipf.expand(vocab, vocab), successors, replacement=False, generator=generator)
    odds = 2.0 ** -torch.arange(successors, dtype=torch.float64)
    tokens = torch.empty(samples, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(zipf, samples, replacement=True, generator=generator)
    for position in range(context):
        choice = torch.multinomial(odds, samples, replacement=True, generator=generator)
        tokens[:, position + 1] = table[tokens[:, position], choice]
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def template_images(
    samples: int, classes: int = 10, size: int = 32, seed: int = 0, noise: float = 3.0, shift: int = 4
) -> torch.utils.data.TensorDataset:
    """RGB images ``(samples, 3, size, size)`` of ``classes`` balanced classes, identical for the same arguments.

    Each class has a smooth random template (8x8 noise upsampled); an image is its class's
    template moved by up to ``shift`` pixels each way, plus white noise of std ``noise``, so a
    classifier has to find shifted patterns under noise: a convolutional net learns it within a
    few epochs, a linear one hardly.
    """
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.randn(classes, 3, 8, 8, generator=generator)
    templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    templates = (templates - templates.mean(dim=(1, 2, 3), keepdim=True)) / templates.std(dim=(1, 2, 3), keepdim=True)
    labels = torch.arange(samples) % classes
    labels = labels[torch.randperm(samples, generator=generator)]
    shifts = torch.randint(-shift, shift + 1, (samples, 2), generator=generator)
    images = torch.stack(
        [
            torch.roll(templates[int(c)], (int(dy), int(dx)), dims=(1, 2))
            for c, (dy, dx) in zip(labels, shifts, strict=True)
        ]
    )
    images += noise * torch.randn(images.shape, generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


ARCHITECTURES = ("mlp", "transformer", "convnet")
"""What ``build_module``, ``synthetic_data`` and ``describe`` build: ``Classifier``, ``TransformerLM``,
``ResidualConvNet``."""


def build_module(arch: str, lr: float | None = None, **size: Any) -> SyntheticTaskModule:
    """The module of ``arch`` with its size arguments (``size``), from its fixed seed.

    ``lr=None`` keeps the module's own default (the MLP's: 0.01, SGD at momentum 0.9).
    """
    options: dict[str, Any] = {} if lr is None else {"lr": lr}
    if arch == "mlp":
        return Classifier(size["features"], size["hidden"], size["classes"], momentum=0.9, **({"lr": 0.01} | options))
    if arch == "transformer":
        return TransformerLM(**size, **options)
    if arch == "convnet":
        return ResidualConvNet(**size, **options)
    raise ValueError(f"unknown architecture {arch!r}; choose from {list(ARCHITECTURES)}")


def synthetic_data(arch: str, samples: int, seed: int = 0, **size: Any) -> torch.utils.data.TensorDataset:
    """``samples`` inputs and labels for the module ``build_module(arch, **size)`` builds, the same for a seed.

    MLP: ``random_classification`` (random labels: fine for timing, not learnable); Transformer:
    ``markov_tokens`` (a chain that depends on the seed too, so split one call into train and
    validation); convnet: ``template_images`` of 32x32 pixels.
    """
    if arch == "mlp":
        return random_classification(samples, size["features"], size["classes"], seed=seed)
    if arch == "transformer":
        return markov_tokens(samples, size.get("vocab", 2048), size.get("context", 64), seed=seed)
    if arch == "convnet":
        return template_images(samples, size.get("classes", 10), seed=seed)
    raise ValueError(f"unknown architecture {arch!r}; choose from {list(ARCHITECTURES)}")


def describe(arch: str, **size: Any) -> str:
    """One line for a report: ``MLP 256-1024-512-10``, ``Transformer LM (vocab 2048, d_model 192, ...)``, ..."""
    if arch == "mlp":
        return f"MLP {'-'.join(map(str, [size['features'], *size['hidden'], size['classes']]))}"
    if arch == "transformer":
        s = _with_defaults(TransformerLM, size)
        return (
            f"Transformer LM (vocab {s['vocab']}, d_model {s['d_model']}, {s['layers']} layers, {s['heads']} heads, "
            f"context {s['context']}, tied embedding)"
        )
    if arch == "convnet":
        s = _with_defaults(ResidualConvNet, size)
        channels = "/".join(map(str, s["channels"]))
        blocks = f"{s['blocks']} block{'s' * (s['blocks'] != 1)}"
        return f"ResNet with BatchNorm ({channels} channels, {blocks} per stage, {s['classes']} classes)"
    raise ValueError(f"unknown architecture {arch!r}; choose from {list(ARCHITECTURES)}")


def _with_defaults(module: type[nn.Module], size: dict[str, Any]) -> dict[str, Any]:
    parameters = inspect.signature(module).parameters.items()
    return {name: parameter.default for name, parameter in parameters} | size


def tensor_count(model: nn.Module) -> int:
    """Trainable parameter tensors (a tied weight once): how many gradients a sync hands to Horovod."""
    return sum(1 for p in model.parameters() if p.requires_grad)


def resident() -> dict[str, int]:
    """This process's resident bytes now (``VmRSS``) and at their peak since the last reset (``VmHWM``)."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def reset_peak() -> None:
    """The peak resident memory (``VmHWM``) set to what is resident now."""
    Path("/proc/self/clear_refs").write_text("5")


def one_thread_per_worker() -> None:
    """Workers share few cores; one intra-op thread each keeps them from fighting over them."""
    torch.set_num_threads(1)
