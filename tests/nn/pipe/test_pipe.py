"""Pipe in one process on CPU: transparency against the plain module, errors, BatchNorm."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.nn.pipe import BalanceError, DeferredBatchNorm, Pipe, is_recomputing
from shardkit.nn.pipe.pipe import verify_no_shared_parameters
from shardkit.testing import assert_tensors_close


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


class PairIn(nn.Module):
    """Takes ``(x, y)`` as one argument, returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = xy
        return torch.tanh(self.lin(x)) + y, y * 2


class PairOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = xy
        return self.lin(x * y)


def tuple_model() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(PairIn(), PairIn(), PairOut())


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_transparent(
    model: nn.Sequential, balance: list[int], inputs: tuple[torch.Tensor, ...], **kwargs: object
) -> None:
    """Outputs, parameter gradients and input gradients of Pipe equal the plain module's."""
    reference = copy.deepcopy(model)
    ref_in = [t.clone().requires_grad_() for t in inputs]
    pipe_in = [t.clone().requires_grad_() for t in inputs]
    expected = reference(ref_in[0] if len(ref_in) == 1 else tuple(ref_in))
    pipe = Pipe(model, balance, devices=["cpu"] * len(balance), **kwargs)  # type: ignore[arg-type]
    actual = pipe(pipe_in[0] if len(pipe_in) == 1 else tuple(pipe_in))
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    assert_tensors_close(actual, expected, atol=1e-6, name=f"output {kwargs}")
    (actual * torch.arange(actual.numel()).view_as(actual)).sum().backward()
    (expected * torch.arange(expected.numel()).view_as(expected)).sum().backward()
    got, want = grads_of(model), grads_of(reference)
    assert got.keys() == want.keys() and want
    for name in want:
        assert_tensors_close(got[name], want[name], atol=1e-5, name=f"grad {name} {kwargs}")
    for i, (a, e) in enumerate(zip(pipe_in, ref_in)):
        assert a.grad is not None and e.grad is not None
        assert_tensors_close(a.grad, e.grad, atol=1e-6, name=f"input grad {i} {kwargs}")


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4, 5])
def test_transparency_tensor(chunks: int, checkpoint: str) -> None:
    # 11 rows: 4, 4, 3 / 3, 3, 3, 2 / 3, 2, 2, 2, 2 -- an uneven last micro-batch
    check_transparent(mlp(), [1, 2, 2], (torch.randn(11, 6),), chunks=chunks, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4, 5])
def test_transparency_tuple_input_and_tuple_output(chunks: int, checkpoint: str) -> None:
    inputs = (torch.randn(7, 6), torch.randn(7, 6))
    check_transparent(tuple_model(), [2, 1], inputs, chunks=chunks, checkpoint=checkpoint)


def test_output_is_a_tuple_when_the_last_layer_returns_one() -> None:
    model = nn.Sequential(PairIn(), PairIn())
    ref = copy.deepcopy(model)
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    out = Pipe(model, [1, 1], devices=["cpu", "cpu"], chunks=3)((x, y))
    want = ref((x, y))
    assert isinstance(out, tuple) and len(out) == 2
    for a, e in zip(out, want):
        assert_tensors_close(a, e, atol=1e-6)


def test_dropout_draws_the_same_mask_when_recomputed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.5), nn.Linear(32, 2))
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6)
    torch.manual_seed(7)
    pipe = Pipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="always")
    pipe(x).pow(2).sum().backward()
    torch.manual_seed(7)
    for part in torch.tensor_split(x, 2):  # what the pipeline does, micro-batch by micro-batch
        plain(part).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_tensors_close(p.grad, q.grad, atol=1e-6, name=name)


def test_no_checkpointing_in_eval_or_without_grad() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(is_recomputing())
            return x.sin()  # saves x for backward, so it is recomputed

    pipe = Pipe(
        nn.Sequential(nn.Linear(2, 2), Probe()),
        [1, 1],
        devices=["cpu", "cpu"],
        chunks=2,
        checkpoint="always",
    )
    pipe(torch.randn(4, 2)).sum().backward()
    assert seen == [False, False, True, True]  # two forwards, then two recomputations
    seen.clear()
    with torch.no_grad():
        pipe(torch.randn(4, 2))
    pipe.eval()
    pipe(torch.randn(4, 2)).sum().backward()
    assert seen == [False] * 4


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def test_recomputation_does_not_update_batch_norm_twice() -> None:
    # regression: the backward-time forward of a checkpointed micro-batch used to apply
    # the BatchNorm momentum a second time (num_batches_tracked 2 instead of 1)
    model = bn_model()
    plain = copy.deepcopy(model)
    x = torch.randn(16, 4)
    Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=1, checkpoint="always")(x).sum().backward()
    plain(x).sum().backward()
    bn, ref = model[1], plain[1]
    assert int(bn.num_batches_tracked) == 1
    assert_tensors_close(bn.running_mean, ref.running_mean, atol=1e-6, name="running_mean")
    assert_tensors_close(bn.running_var, ref.running_var, atol=1e-6, name="running_var")
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_tensors_close(p.grad, q.grad, atol=1e-5, name=name)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_deferred_batch_norm_tracks_the_whole_mini_batch(checkpoint: str) -> None:
    model = bn_model()
    plain = copy.deepcopy(model)
    pipe = Pipe(
        model,
        [2, 2],
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    assert isinstance(pipe[1], DeferredBatchNorm)
    for step in range(2):
        x = torch.randn(13, 4) + step
        pipe(x).sum().backward()
        plain(x)
    bn, ref = pipe[1], plain[1]
    assert int(bn.num_batches_tracked) == 2
    assert_tensors_close(bn.running_mean, ref.running_mean, atol=1e-5, name="running_mean")
    assert_tensors_close(bn.running_var, ref.running_var, atol=1e-5, name="running_var")
    pipe.eval()
    plain.eval()
    x = torch.randn(5, 4)
    assert_tensors_close(pipe(x), plain(x), atol=1e-5, name="eval output")


def test_plain_batch_norm_is_updated_per_micro_batch() -> None:
    pipe = Pipe(bn_model(), [2, 2], devices=["cpu", "cpu"], chunks=4)
    pipe(torch.randn(12, 4)).sum().backward()
    assert int(pipe[1].num_batches_tracked) == 4  # why deferred_batch_norm exists


def test_pipe_container_api() -> None:
    model = mlp()
    layers = list(model)
    pipe = Pipe(model, [2, 3], chunks=2)
    assert len(pipe) == 5 and list(pipe) == layers and pipe[-1] is layers[-1]
    assert pipe.devices == [torch.device("cpu")] * 2 or torch.cuda.is_available()
    assert list(pipe.state_dict()) == [
        f"partitions.{j}.{k}.{w}" for j, k in ((0, 0), (1, 2), (1, 4)) for w in ("weight", "bias")
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"balance": [2, 2]},
            BalanceError,
            "module has 5 layers, but the sum of balance [2, 2] is 4",
        ),
        ({"balance": [2, 0, 3]}, BalanceError, "integers >= 1"),
        ({"balance": [2, 3], "chunks": 0}, ValueError, "chunks must be >= 1"),
        (
            {"balance": [2, 3], "checkpoint": "sometimes"},
            ValueError,
            "checkpoint is not one of 'always', 'except_last', or 'never': unknown "
            "checkpoint mode 'sometimes'",
        ),
        ({"balance": [2, 3], "devices": ["cpu"]}, BalanceError, "2 partitions but 1 devices"),
    ],
)
def test_errors_name_the_values(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=None) as info:
        Pipe(mlp(), **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_error_for_a_batch_smaller_than_chunks() -> None:
    pipe = Pipe(mlp(), [2, 3], devices=["cpu", "cpu"], chunks=4)
    with pytest.raises(
        ValueError, match=r"batch of 3 rows cannot be split into 4 micro-batches; use chunks <= 3"
    ):
        pipe(torch.randn(3, 6))


def test_error_for_a_module_that_is_not_sequential() -> None:
    with pytest.raises(
        TypeError, match="module must be nn.Sequential to be partitioned.*got Linear"
    ):
        Pipe(nn.Linear(2, 2), [1])  # type: ignore[arg-type]


def test_error_for_a_layer_used_twice_has_fairscales_words() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"module with duplicate children is not supported: layers \['0'\]"
    ):
        Pipe(nn.Sequential(layer, layer), [1, 1], devices=["cpu", "cpu"])


def test_error_for_inputs_that_are_not_tensors() -> None:
    pipe = Pipe(mlp(), [2, 3], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"\['Tensor', 'int'\]"):
        pipe((torch.randn(2, 6), 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"share dim 0 .*\[4, 3\]"):
        pipe((torch.randn(4, 6), torch.randn(3, 6)))


def test_error_for_a_parameter_shared_across_devices() -> None:
    lin = nn.Linear(2, 2)
    parts = [nn.Sequential(lin), nn.Sequential(nn.Sequential(lin))]
    verify_no_shared_parameters(parts, [torch.device("cpu")] * 2)  # one device: allowed
    with pytest.raises(ValueError, match="partitions 0 and 1 share a parameter of shape"):
        verify_no_shared_parameters(parts, [torch.device("cpu"), torch.device("meta")])


# FairScale's surface (its tests/nn/pipe/test_pipe.py, with shardkit's own messages) ------


def test_extra_devices_are_ignored() -> None:
    """The ``devices=range(n_gpus)`` pattern: the first len(balance) devices are used."""
    pipe = Pipe(mlp(), [2, 3], devices=["cpu", "cpu", "meta", "meta", "cpu"], chunks=2)
    assert pipe.devices == [torch.device("cpu")] * 2
    assert {p.device.type for p in pipe.parameters()} == {"cpu"}
    x = torch.randn(4, 6)
    assert_tensors_close(pipe(x), mlp_copy(pipe)(x), atol=1e-6, name="output")


def mlp_copy(pipe: Pipe) -> nn.Sequential:
    return nn.Sequential(*(copy.deepcopy(layer) for layer in pipe))


def test_too_few_devices_is_a_balance_error_and_an_index_error() -> None:
    with pytest.raises(IndexError, match="4 partitions but 1 devices"):
        Pipe(nn.Sequential(*(nn.Linear(1, 1) for _ in range(4))), [1, 1, 1, 1], devices=["cpu"])
    with pytest.raises(BalanceError):
        Pipe(mlp(), [2, 3], devices=["cpu"])


def test_empty_module() -> None:
    pipe = Pipe(nn.Sequential(), [])
    assert pipe.balance == [] and pipe.devices == [] and len(pipe) == 0 and list(pipe) == []
    x = torch.tensor(42)
    assert pipe(x) is x
    pair = (torch.tensor(42), torch.ones(2))
    assert pipe(pair) is pair
    with pytest.raises(TypeError, match="must be a tensor or a non-empty tuple of tensors"):
        pipe(42)  # type: ignore[arg-type]
    with pytest.raises(BalanceError, match="sum of balance \\[1\\] is 1"):
        Pipe(nn.Sequential(), [1])


def test_chunks_and_checkpoint_are_normalised() -> None:
    class MyString:
        def __init__(self, value: str) -> None:
            self.value = value

        def __str__(self) -> str:
            return self.value

    pipe = Pipe(
        nn.Sequential(nn.Linear(1, 1)),
        balance=(1,),
        devices=("cpu",),
        chunks=42.000,  # type: ignore[arg-type]
        checkpoint=MyString("always"),  # type: ignore[arg-type]
    )
    assert pipe.balance == [1] and pipe.devices == [torch.device("cpu")]
    assert pipe.chunks == 42 and type(pipe.chunks) is int
    assert pipe.checkpoint == "always" and type(pipe.checkpoint) is str
    for bad in (2.5, "four", 0, -1):
        with pytest.raises(ValueError, match="chunks must be"):
            Pipe(nn.Sequential(nn.Linear(1, 1)), [1], chunks=bad)  # type: ignore[arg-type]


def test_moving_a_pipe_is_refused_and_casting_allowed() -> None:
    pipe = Pipe(mlp(), [2, 3], devices=["cpu", "cpu"])
    moves = [
        lambda: pipe.cuda(),
        lambda: pipe.cpu(),
        lambda: pipe.to(torch.device("cuda")),
        lambda: pipe.to(0),
        lambda: pipe.to("cpu"),
        lambda: pipe.to(device=0),
        lambda: pipe.to(torch.rand(1)),
        lambda: pipe.to(tensor=torch.rand(1)),
        lambda: pipe.to("cpu", torch.float64),
    ]
    for move in moves:
        with pytest.raises(TypeError, match=r"moving the whole Pipe would put every partition"):
            move()
    assert {p.dtype for p in pipe.parameters()} == {torch.float32}  # nothing moved or cast
    assert pipe.half() is pipe and {p.dtype for p in pipe.parameters()} == {torch.float16}
    assert pipe.to(torch.double) is pipe
    assert {p.dtype for p in pipe.parameters()} == {torch.float64}
    pipe.to(dtype=torch.float)
    assert {p.dtype for p in pipe.parameters()} == {torch.float32}
    assert pipe(torch.randn(3, 6)).dtype == torch.float32


def test_missing_or_wrong_balance_recommends_the_balancing_helpers() -> None:
    with pytest.raises(ValueError, match=r"Pipe needs balance=.*balance_by_size.*balance_by_time"):
        Pipe(mlp())
    with pytest.raises(ValueError, match=r"balance_by_size"):
        Pipe(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1])
    with pytest.raises(ValueError, match=r"balance_by_size.*balance_by_time"):
        Pipe(mlp(), [2, 0, 3])


def test_profiler_labels_every_micro_batch_and_partition() -> None:
    from torch.profiler import ProfilerActivity, profile

    pipe = Pipe(mlp(), [2, 3], devices=["cpu", "cpu"], chunks=3, checkpoint="except_last")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pipe(torch.randn(6, 6)).sum().backward()
    names = [e.name for e in prof.events() if e.name.startswith("Pipe::")]
    forwards = sorted(n for n in names if n.startswith("Pipe::forward"))
    assert forwards == sorted(
        f"Pipe::forward micro_batch={i} partition={j}" + (" checkpointed" if i < 2 else "")
        for i in range(3)
        for j in range(2)
    )
    copies = sorted(n for n in names if n.startswith("Pipe::copy"))
    assert copies == sorted(
        f"Pipe::copy micro_batch={i} partition={j}" for i in range(3) for j in range(2)
    )


class _Log(nn.Module):
    """Records (micro-batch, partition) at each call; raises on ``fail_at`` calls."""

    def __init__(self, log: list[tuple[int, int]], partition: int, fail: bool = False) -> None:
        super().__init__()
        self.log, self.partition, self.fail, self.calls = log, partition, fail, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError(f"partition {self.partition} fails")
        self.log.append((self.calls, self.partition))
        self.calls += 1
        return x * 2


def test_layers_are_called_in_fairscales_clock_order_and_a_failure_stops_the_tick() -> None:
    log: list[tuple[int, int]] = []
    pipe = Pipe(nn.Sequential(_Log(log, 0), _Log(log, 1)), [1, 1], devices=["cpu"] * 2, chunks=3)
    out = pipe(torch.arange(3.0).unsqueeze(1))
    assert log == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (2, 1)]
    torch.testing.assert_close(out, torch.arange(3.0).unsqueeze(1) * 4)
    log.clear()
    layers = [_Log(log, 0), _Log(log, 1), _Log(log, 2), _Log(log, 3, fail=True)]
    pipe = Pipe(nn.Sequential(*layers), [1, 1, 1, 1], devices=["cpu"] * 4, chunks=3)
    with pytest.raises(RuntimeError, match="partition 3 fails"):
        pipe(torch.zeros(3, 1))
    # tick 3 runs (2, 1), (1, 2), then (0, 3) fails: partition 2 saw two micro-batches
    assert log == [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1), (1, 2)]


def _count_nodes(output: torch.Tensor, name: str) -> int:
    seen: set[object] = set()
    stack, count = [output.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == name
        stack.extend(next_node for next_node, _ in node.next_functions)
    return count


@pytest.mark.parametrize(
    ("checkpoint", "marked"), [("always", 6), ("except_last", 4), ("never", 0)]
)
def test_checkpointed_micro_batches_show_in_the_graph_and_train_as_plain(
    checkpoint: str, marked: int
) -> None:
    # 3 micro-batches x 2 partitions; the first partition's output comes from an
    # in-place layer (the marker nodes take it in place once more)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)
    )
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    pipe = Pipe(model, [4, 1], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint)
    out = pipe(x)
    assert _count_nodes(out, "CheckpointBackward") == marked
    assert _count_nodes(out, "RecomputeBackward") == marked
    (out * torch.arange(12.0).view(6, 2)).sum().backward()
    (reference(x) * torch.arange(12.0).view(6, 2)).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None
        assert_tensors_close(p.grad, q.grad, atol=1e-6, name=name)
    pipe.eval()
    assert _count_nodes(pipe(x), "CheckpointBackward") == 0  # no checkpointing in eval
