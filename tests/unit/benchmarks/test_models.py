"""The benchmarks' Transformer LM and ResNet (hvd_plugins.testing.benchmarking), in this process, on small sizes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from hvd_plugins.core import sync_batchnorm
from hvd_plugins.core.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from hvd_plugins.testing import benchmarking as bench

TINY_LM: dict[str, Any] = {"vocab": 64, "d_model": 32, "layers": 2, "heads": 4, "context": 16}
TINY_CONVNET: dict[str, Any] = {"channels": (4, 8), "blocks": 1, "classes": 4}


def test_the_default_models_have_the_parameters_and_tensors_the_reports_quote() -> None:
    lm, convnet = bench.TransformerLM(), bench.ResidualConvNet()
    # 2 embeddings, 16 tensors per block (2 LayerNorms, q/k/v/out and 2 MLP layers, weights and biases), final norm
    assert (bench.parameter_count(lm), bench.tensor_count(lm)) == (2_668_512, 2 + 16 * 16 + 2)
    # stem conv + BN, 6 blocks of 2 convs + 2 BNs, 2 projection shortcuts (conv + BN), the linear head
    assert (bench.parameter_count(convnet), bench.tensor_count(convnet)) == (175_258, 3 + 6 * 6 + 2 * 3 + 2)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in convnet.modules()) == 1 + 6 * 2 + 2
    assert bench.describe("transformer") == (
        "Transformer LM (vocab 2048, d_model 112, 16 layers, 4 heads, context 64, tied embedding)"
    )
    assert (
        bench.describe("convnet", blocks=1)
        == "ResNet with BatchNorm (16/32/64 channels, 1 block per stage, 10 classes)"
    )
    assert bench.describe("mlp", features=8, hidden=(16, 4), classes=3) == "MLP 8-16-4-3"


def test_the_output_projection_is_the_token_embedding() -> None:
    lm = bench.TransformerLM(**TINY_LM)
    assert lm.lm_head.weight is lm.embedding.weight
    names = [name for name, _ in lm.named_parameters()]
    assert "embedding.weight" in names and "lm_head.weight" not in names  # one tensor, synced once
    logits = lm(torch.zeros(3, 16, dtype=torch.long))
    assert logits.shape == (3, 16, 64)
    with pytest.raises(ValueError, match="longer than the context 16"):
        lm(torch.zeros(1, 17, dtype=torch.long))


def test_the_same_seed_builds_the_same_weights_and_leaves_the_global_generator_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(1)
    torch.manual_seed(7)
    one, two = bench.TransformerLM(**TINY_LM), bench.TransformerLM(**TINY_LM)
    assert torch.rand(1) == expected
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True))
    other = bench.ResidualConvNet(**TINY_CONVNET, seed=1)
    same = bench.ResidualConvNet(**TINY_CONVNET, seed=0)
    assert not torch.equal(other.head.weight, same.head.weight)


def test_synthetic_data_is_the_same_for_a_seed_and_has_its_structure() -> None:
    tokens = bench.markov_tokens(200, vocab=64, context=16, seed=3)
    again = bench.markov_tokens(200, vocab=64, context=16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(tokens.tensors, again.tensors, strict=True))
    assert not torch.equal(tokens.tensors[0], bench.markov_tokens(200, vocab=64, context=16, seed=4).tensors[0])
    inputs, labels = tokens.tensors
    assert inputs.shape == labels.shape == (200, 16) and torch.equal(inputs[:, 1:], labels[:, :-1])  # shifted by one
    followers: dict[int, set[int]] = {}
    for token, after in zip(inputs.flatten().tolist(), labels.flatten().tolist(), strict=True):
        followers.setdefault(token, set()).add(after)
    assert max(len(f) for f in followers.values()) <= 4  # each token has at most 4 successors

    images = bench.template_images(40, classes=4, seed=3)
    assert all(
        torch.equal(a, b) for a, b in zip(images.tensors, bench.template_images(40, 4, seed=3).tensors, strict=True)
    )
    assert images.tensors[0].shape == (40, 3, 32, 32)
    assert torch.bincount(images.tensors[1]).tolist() == [10, 10, 10, 10]  # balanced classes


@pytest.mark.parametrize(
    ("arch", "size", "lr"),
    [
        ("transformer", TINY_LM, 3e-3),
        ("convnet", TINY_CONVNET, 0.1),
        ("mlp", {"features": 8, "hidden": (16,), "classes": 3}, 0.1),
    ],
    ids=["transformer", "convnet", "mlp"],
)
def test_a_few_optimizer_steps_reduce_the_loss_on_the_synthetic_data(
    arch: str, size: dict[str, Any], lr: float
) -> None:
    module = bench.build_module(arch, lr=lr, **size)
    if arch == "convnet":  # the module pools globally: 16x16 images learn alike at a quarter of the work
        inputs, labels = bench.template_images(32, size["classes"], size=16, shift=2).tensors
    else:
        inputs, labels = bench.synthetic_data(arch, 32, seed=0, **size).tensors
    optimizer = module.configure_optimizers()
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = module.loss(inputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.85 * losses[0], losses
    assert 0.0 <= module.accuracy(torch.utils.data.TensorDataset(inputs, labels), batch_size=10) <= 1.0
    assert module.training  # accuracy evaluates in eval mode and puts the module back


def test_the_convnet_converts_to_the_strategys_sync_batchnorm_and_runs_forward_and_backward(
    fake_horovod: Callable[..., Any],
) -> None:
    hvd = fake_horovod(sync_batchnorm, size=2)  # the other worker contributes zeros: the statistics stay local
    plain = bench.ResidualConvNet(**TINY_CONVNET)
    converted = convert_sync_batchnorm(copy.deepcopy(plain))
    assert not any(type(m) is nn.BatchNorm2d for m in converted.modules())
    assert sum(isinstance(m, SyncBatchNorm) for m in converted.modules()) == sum(
        isinstance(m, nn.BatchNorm2d) for m in plain.modules()
    )
    images = bench.template_images(6, classes=4).tensors[0]
    logits = converted(images)
    assert logits.shape == (6, 4)
    torch.testing.assert_close(logits, plain(images), atol=1e-4, rtol=1e-4)
    logits.sum().backward()
    assert all(p.grad is not None for p in converted.parameters())
    assert sum(1 for call in hvd.calls if call[0] == "allreduce") == 2 * len(
        [m for m in converted.modules() if isinstance(m, SyncBatchNorm)]
    )  # one allreduce of the statistics per layer forward, one of their gradients backward
