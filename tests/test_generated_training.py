"""Hypothesis-generated training loops, run eagerly and under ``adaptive_eager()``, compared at
every step.

The straight-line programs of test_generated_programs.py run each window once, so they never meet
what a training loop does to the fuser: the same region run again with state carried across (an
optimizer's momentum, BatchNorm's running statistics), a batch size that changes under a region
compiled for another (a smaller last batch, a second input size), a learning rate that changes
every step, gradients accumulated into ``.grad`` over several windows, a second model's regions
beside the first, another thread's windows at the same time.

A loop is one or two *trainees* (a model, its loss, an optimizer with state, a learning-rate
schedule), each trained on its own data over one list of (batch, extent) sizes, interleaved step
by step. Everything the loop could observe is compared with plain eager's: every step's loss,
gradients and clipped norm, the values it read in the middle (``loss.item()`` every k steps), the
learning rates, and at the end every parameter, buffer and optimizer state tensor (values, dtypes,
shapes, strides). Replay must be bitwise; compiled regions (compiled at first sight, in place)
within torch.testing's float32 tolerances.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import adaptive_eager as ae
import fuser
from _oracle import COMPILED, REPLAY, first_difference
from adaptive_eager import adaptive_eager



FEATURES, CLASSES, CHANNELS, VOCAB = 6, 3, 3, 13
RNG_SEED = 4321  # the global generator at the start of a loop (Dropout draws from it)
THREAD_TIMEOUT_S = 120

# -------------------------------------------------------------------------------------------------
# Loops


@dataclasses.dataclass(frozen=True)
class Net:
    """A small model and its loss. ``extent`` of a batch: the sequence length of an MLP over
    sequences or of an embedding's tokens, the image side (minus 2) of a conv net (an MLP over
    plain rows has none)."""

    kind: str  # "mlp" | "conv" | "embedding"
    blocks: tuple[tuple[str, ...], ...]  # mlp: per hidden layer, what follows its Linear; conv: per conv layer
    width: int
    loss: str  # "mse" | "squares" (the same, written out: no mse_loss op) | "cross_entropy"
    sequence: bool = False  # mlp: inputs (batch, extent, features) instead of (batch, features)
    adaptive: bool = True  # conv: adaptive pooling before the classifier (any image size)
    extent: int = 2  # conv without adaptive pooling: the one extent its classifier takes
    channels_last: bool = False  # conv: model and images in channels_last
    seed: int = 0

    def build(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        nn = torch.nn
        if self.kind == "mlp":
            layers, n = [], FEATURES
            for block in self.blocks:
                layers.append(nn.Linear(n, self.width))
                layers += [_MODULES[name](self.width) for name in block]
                n = self.width
            layers.append(nn.Linear(n, CLASSES))
        elif self.kind == "conv":
            layers, c = [], CHANNELS
            for i, block in enumerate(self.blocks):
                # no bias before BatchNorm: its gradient would be rounding noise, which Adam,
                # RMSprop and Adagrad scale up to a full step (eager's noise and a fused kernel's differ)
                layers.append(nn.Conv2d(c, self.width, 3, padding=1, bias="batchnorm" not in block))
                layers += [_MODULES[name](self.width) for name in block]
                if i == 0:
                    layers.append(nn.MaxPool2d(2))
                c = self.width
            side = 2 if self.adaptive else (self.extent + 2) // 2
            if self.adaptive:
                layers.append(nn.AdaptiveAvgPool2d(2))
            layers += [nn.Flatten(), nn.Linear(c * side * side, CLASSES)]
        else:
            return _Bag(self.width)
        model = nn.Sequential(*layers)
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def batch(self, n: int, extent: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "mlp":
            x = torch.randn((n, extent, FEATURES) if self.sequence else (n, FEATURES), generator=g)
            rows = x.shape[:-1]
        elif self.kind == "conv":
            x = torch.randn(n, CHANNELS, extent + 2, extent + 2, generator=g)
            if self.channels_last:
                x = x.to(memory_format=torch.channels_last)
            rows = (n,)
        else:
            x = torch.randint(0, VOCAB, (n, extent), generator=g)
            rows = (n,)
        if self.loss != "cross_entropy":
            return x, torch.randn(*rows, CLASSES, generator=g)
        return x, torch.randint(0, CLASSES, rows, generator=g)

    def loss_of(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.loss == "mse":
            return F.mse_loss(out, y)
        if self.loss == "squares":
            return (out - y).square().mean()
        return F.cross_entropy(out.flatten(0, -2), y.flatten())


class _Bag(torch.nn.Module):
    """Embedding, mean over the tokens, linear classifier."""

    def __init__(self, width: int):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.head = torch.nn.Linear(width, CLASSES)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


_MODULES = {
    "relu": lambda w: torch.nn.ReLU(),
    "gelu": lambda w: torch.nn.GELU(),
    "tanh": lambda w: torch.nn.Tanh(),
    "layernorm": lambda w: torch.nn.LayerNorm(w),
    "batchnorm": lambda w: torch.nn.BatchNorm2d(w),
    "dropout": lambda w: torch.nn.Dropout(0.25),
}


@dataclasses.dataclass(frozen=True)
class Optim:
    name: str  # a torch.optim class
    kwargs: tuple[tuple[str, object], ...]
    schedule: str | None = None  # "step" | "cosine" | "onecycle" | "lambda", stepped after each optimizer step

    def build(self, params, steps: int):
        opt = getattr(torch.optim, self.name)(params, **dict(self.kwargs))
        lr = opt.defaults["lr"]
        sched = {
            None: lambda: None,
            "step": lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1)),
            "onecycle": lambda: torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=2 * lr, total_steps=max(steps, 1),
                cycle_momentum="momentum" in opt.defaults or "betas" in opt.defaults),
            "lambda": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
        }[self.schedule]()
        return opt, sched


@dataclasses.dataclass(frozen=True)
class Trainee:
    net: Net
    optim: Optim
    data_seed: int


@dataclasses.dataclass(frozen=True)
class Loop:
    trainees: tuple[Trainee, ...]
    sizes: tuple[tuple[int, int], ...]  # (batch, extent) of each step
    accumulate: int = 1  # backward passes per optimizer step (the last step always steps)
    set_to_none: bool = True  # zero_grad's argument
    clip: float | None = None  # clip_grad_norm_'s max_norm before each optimizer step
    log_every: int | None = None  # loss.item() every this many steps (a sync in the middle of a window)

    def steps_at(self) -> list[bool]:
        """Whether the optimizer steps after each step's backward."""
        n = len(self.sizes)
        return [(i + 1) % self.accumulate == 0 or i == n - 1 for i in range(n)]


@dataclasses.dataclass
class Setup:
    """A trainee's objects, built outside the mode (as a program builds them before its loop)."""

    trainee: Trainee
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: object
    data: list


def set_up(loop: Loop) -> list[Setup]:
    out = []
    n_steps = sum(loop.steps_at())
    for tr in loop.trainees:
        model = tr.net.build()
        opt, sched = tr.optim.build(model.parameters(), n_steps)
        g = torch.Generator().manual_seed(tr.data_seed)
        out.append(Setup(tr, model, opt, sched, [tr.net.batch(n, e, g) for n, e in loop.sizes]))
    return out


def train(loop: Loop, setups: list[Setup], options: dict | None, stop_on: tuple = ()) -> dict:
    """Run ``loop`` (under ``adaptive_eager(**options)`` unless None); what it observed and its end
    state. An exception in ``stop_on`` ends the loop as a program that saves what it has on Ctrl-C
    would (the end state is then not compared: it is that of a step cut in the middle)."""
    assert not ae.is_enabled(), "adaptive eager is still on from an earlier run"
    steps: list = []  # per step and trainee: loss, and where the optimizer stepped: grads and norm
    logged: list = []
    stepping = loop.steps_at()
    torch.manual_seed(RNG_SEED)
    try:
        with adaptive_eager(**options) if options is not None else contextlib.nullcontext():
            for i in range(len(loop.sizes)):
                for k, s in enumerate(setups):
                    steps.append({})  # kept as it fills: an interrupted step keeps what it made
                    _step(loop, s, i, stepping[i], logged, k, steps[-1])
    except stop_on:
        return {"steps": steps, "logged": logged, "final": None}
    final = [
        {"model": s.model.state_dict(), "optimizer": s.opt.state_dict(), "lr": s.opt.param_groups[0]["lr"]}
        for s in setups
    ]
    return {"steps": steps, "logged": logged, "final": final}


def _step(loop: Loop, s: Setup, i: int, stepping: bool, logged: list, k: int, seen: dict) -> None:
    x, y = s.data[i]
    loss = s.trainee.net.loss_of(s.model(x), y)
    seen["loss"] = loss.detach()
    (loss / loop.accumulate if loop.accumulate > 1 else loss).backward()
    if loop.log_every and i % loop.log_every == 0:
        logged.append((i, k, loss.item()))
    if stepping:
        params = [p for p in s.model.parameters() if p.grad is not None]
        if loop.clip is not None:
            seen["norm"] = torch.nn.utils.clip_grad_norm_(params, loop.clip)
        seen["grads"] = [p.grad.clone() for p in params]
        s.opt.step()
        if s.sched is not None:
            s.sched.step()
        s.opt.zero_grad(set_to_none=loop.set_to_none)


def assert_training_matches_eager(loop: Loop, options: dict) -> None:
    want = train(loop, set_up(loop), None)
    got = train(loop, set_up(loop), options)
    _assert_same(want, got, loop, options)


def _assert_same(want: dict, got: dict, loop: Loop, options: dict) -> None:
    exact = options.get("backend") == "replay"
    diff = first_difference(want, got, "loop", exact=exact)
    assert diff is None, f"{diff}\n{loop!r}"


# -------------------------------------------------------------------------------------------------
# Drawing loops


@st.composite
def size_plans(draw, max_steps: int, fixed: bool = False) -> tuple[tuple[int, int], ...]:
    """Batch sizes as loops see them: fixed, an epoch whose last batch is smaller (a DataLoader with
    drop_last=False), a second input size from the middle of the run on, or random."""
    how = "fixed" if fixed else draw(st.sampled_from(["fixed", "last_smaller", "second_extent", "random"]))
    batch, extent = draw(st.integers(2, 5)), draw(st.integers(1, 4))
    if how == "fixed":
        return ((batch, extent),) * draw(st.integers(2, max_steps))
    if how == "last_smaller":
        full = draw(st.integers(1, max(1, max_steps // 2 - 1)))
        last = draw(st.integers(1, batch - 1))
        epochs = draw(st.integers(1, max(1, max_steps // (full + 1))))
        return ((*((batch, extent),) * full, (last, extent)) * epochs)[:max_steps]
    if how == "second_extent":
        second = draw(st.integers(1, 4).filter(lambda e: e != extent))
        n = draw(st.integers(2, max_steps))
        cut = draw(st.integers(1, n - 1))
        return ((batch, extent),) * cut + ((batch, second),) * (n - cut)
    return tuple(draw(st.lists(st.tuples(st.integers(1, 6), st.just(extent)), min_size=2, max_size=max_steps)))


@st.composite
def nets(draw, extents: set[int], dropout: bool = True) -> Net:
    kind = draw(st.sampled_from(["mlp", "conv", "embedding"]))
    width = draw(st.sampled_from([4, 8]))
    loss = draw(st.sampled_from(["mse", "squares", "cross_entropy"]))
    seed = draw(st.integers(0, 2**16))
    if kind == "mlp":
        extra = ["layernorm", "dropout"] if dropout else ["layernorm"]
        hidden = st.tuples(st.sampled_from(["relu", "gelu", "tanh"])).flatmap(
            lambda act: st.sets(st.sampled_from(extra)).map(lambda more: tuple(sorted(more)) + act))
        return Net(kind, tuple(draw(st.lists(hidden, min_size=1, max_size=2))), width, loss,
                   sequence=draw(st.booleans()), seed=seed)
    if kind == "conv":
        blocks = [("batchnorm", "relu") if draw(st.booleans()) else ("relu",)]
        if draw(st.booleans()):
            blocks.append(("relu",))
        adaptive = len(extents) > 1 or draw(st.booleans())
        return Net(kind, tuple(blocks), width, loss, adaptive=adaptive, extent=min(extents),
                   channels_last=draw(st.booleans()), seed=seed)
    return Net(kind, (), width, loss, seed=seed)


@st.composite
def optims(draw, rmsprop_momentum: bool = True) -> Optim:
    """``rmsprop_momentum=False`` for compiled runs: RMSprop's momentum buffer holds the normalized
    step g / sqrt(v), of size 1 however small the gradient, so a gradient element that is mostly
    rounding (a sum that cancels: a fused kernel rounds it differently from eager, both correctly)
    shows its relative error of ~1e-5 there at full size (the parameters see it times lr)."""
    name = draw(st.sampled_from(["SGD", "Adam", "AdamW", "RMSprop", "Adagrad"]))
    kw: dict = {"foreach": draw(st.booleans())}
    decay = st.sampled_from([0.0, 0.01])
    if name == "SGD":
        kw.update(lr=0.05, momentum=draw(st.sampled_from([0.0, 0.9])), weight_decay=draw(decay))
        if kw["momentum"]:
            kw["nesterov"] = draw(st.booleans())
    elif name in ("Adam", "AdamW"):
        kw.update(lr=0.01, amsgrad=draw(st.booleans()), weight_decay=draw(decay), maximize=draw(st.booleans()))
    elif name == "RMSprop":
        kw.update(lr=0.01, momentum=draw(st.sampled_from([0.0, 0.5] if rmsprop_momentum else [0.0])),
                  centered=draw(st.booleans()),
                  weight_decay=draw(decay))
    else:
        kw.update(lr=0.05, lr_decay=draw(st.sampled_from([0.0, 0.01])), weight_decay=draw(decay))
    schedules = [None, "step", "cosine", "onecycle", "lambda"]
    if name == "RMSprop" and not rmsprop_momentum:
        schedules.remove("onecycle")  # it cycles the momentum, from 0.85 up: a momentum buffer after all
    schedule = draw(st.sampled_from(schedules))
    return Optim(name, tuple(sorted(kw.items())), schedule)


@st.composite
def loops(draw, max_steps: int = 8, max_trainees: int = 2, dropout: bool = True, fixed_sizes: bool = False,
          compiled: bool = False) -> Loop:
    sizes = draw(size_plans(max_steps, fixed_sizes))
    extents = {e for _, e in sizes}
    trainees = tuple(
        Trainee(draw(nets(extents, dropout)), draw(optims(rmsprop_momentum=not compiled)), draw(st.integers(0, 2**16)))
        for _ in range(draw(st.integers(1, max_trainees)))
    )
    return Loop(
        trainees, sizes,
        accumulate=draw(st.sampled_from([1, 1, 2])),
        set_to_none=draw(st.booleans()),
        clip=draw(st.sampled_from([None, None, 0.5])),
        log_every=draw(st.sampled_from([None, None, 1, 3])),
    )


# -------------------------------------------------------------------------------------------------
# Tests

DERANDOMIZED = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Replayed windows through the fuser's region tables (keys, scalar groups, shape classes) without
# compiling them: what two threads share when the inductor backend is on and the regions are cold.
COLD_INDUCTOR = {"backend": "inductor", "hot_after": 10**9, "async_compile": False}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tensors are tiny: handing an op to a second OpenMP thread costs more than the op (the
    loops ran 6x slower with two threads on a loaded 2-core machine), and no result depends on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@settings(DERANDOMIZED, max_examples=80)
@given(loops())
def test_training_loop_matches_eager(loop):
    assert_training_matches_eager(loop, REPLAY)


@settings(DERANDOMIZED, max_examples=20)
@given(loops(), st.sampled_from([3, 17, 64]))
def test_training_loop_matches_eager_with_small_windows(loop, window):
    """Window caps cut steps at places that move as the batch size changes."""
    assert_training_matches_eager(loop, dict(REPLAY, window=window))


# Shrinking would compile every candidate: a failure reports the loop as generated instead. Each
# distinct window compiles (seconds each), so the loops are short and few.
@settings(DERANDOMIZED, max_examples=3, phases=[Phase.explicit, Phase.generate])
@given(loops(max_steps=4, max_trainees=1, compiled=True))
def test_compiled_training_loop_matches_eager(loop):
    """Every window compiled at first sight and in place: a region's later runs, its symbolic
    (varying batch size) and lifted-scalar (changing learning rate) variants."""
    assert_training_matches_eager(loop, COMPILED)


@st.composite
def thread_runs(draw) -> tuple[Loop, dict]:
    """A loop and the options its thread runs it under. No Dropout: the threads share the global
    generator, so the order of their draws is not eager's. Cold inductor regions keep one batch
    size: a second one would compile a symbolic region (seconds, whatever ``hot_after`` says). On
    inductor the optimizer is compiled from its first step (Note [Training captured at once] in
    adaptive_eager._capture) unless the other thread has the mode on then (Note [Traces beside
    other threads], there too), so its loops are the compiled runs' (``optims``): which steps run compiled
    depends on the threads' timing, and both outcomes must agree with eager."""
    options = draw(st.sampled_from([REPLAY, dict(REPLAY, window=5), COLD_INDUCTOR]))
    fixed = options is COLD_INDUCTOR
    loop = draw(loops(max_steps=6, max_trainees=1, dropout=False, fixed_sizes=fixed, compiled=fixed))
    return loop, options


@settings(DERANDOMIZED, max_examples=12)
@given(thread_runs(), thread_runs())
def test_training_loops_in_two_threads_match_eager(main_run, thread_run):
    """Two loops at once, each thread under its own mode, each compared with eager."""
    (main_loop, main_options), (thread_loop, thread_options) = main_run, thread_run
    want = [train(loop, set_up(loop), None) for loop in (main_loop, thread_loop)]
    main_setup, thread_setup = set_up(main_loop), set_up(thread_loop)  # models are built from the global seed
    got: dict = {}

    def in_thread():
        try:
            got["thread"] = train(thread_loop, thread_setup, thread_options)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            got["error"] = e

    worker = threading.Thread(target=in_thread, daemon=True)
    worker.start()
    got["main"] = train(main_loop, main_setup, main_options)
    worker.join(THREAD_TIMEOUT_S)
    assert not worker.is_alive(), f"the training thread did not finish in {THREAD_TIMEOUT_S} s"
    if "error" in got:
        raise got["error"]
    _assert_same(want[0], got["main"], main_loop, main_options)
    _assert_same(want[1], got["thread"], thread_loop, thread_options)


class _InterruptedFlush:
    """``fuser.run_window`` raising KeyboardInterrupt at its ``at``-th call: Ctrl-C during a flush."""

    def __init__(self, at: int):
        self.at, self.calls, self.run_window = at, 0, fuser.run_window

    def __call__(self, window, options, *rest):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.run_window(window, options, *rest)

    def __enter__(self):
        fuser.run_window = self
        return self

    def __exit__(self, *exc):
        fuser.run_window = self.run_window


@settings(DERANDOMIZED, max_examples=20)
@given(loops(max_steps=6), st.integers(1, 10))
def test_training_loop_interrupted_in_a_flush(loop, at):
    """A loop that stops on Ctrl-C and keeps what it has: every value it holds from before the
    interrupted flush is eager's, every value that flush was to compute is NaN (DESIGN.md: never
    the placeholder's uninitialized memory)."""
    want = train(loop, set_up(loop), None)
    with _InterruptedFlush(at) as interrupt:
        got = train(loop, set_up(loop), REPLAY, stop_on=(KeyboardInterrupt,))
    if interrupt.calls < at:
        _assert_same(want, got, loop, REPLAY)  # fewer flushes than that: not interrupted
        return
    assert got["final"] is None, "the interrupt did not reach the program"
    diff = first_difference(want["logged"][: len(got["logged"])], got["logged"], "logged", exact=True)
    assert diff is None, f"{diff}\n{loop!r}"
    computed = True  # the values the program kept, in the order it made them: eager's, then NaN
    for n, (w, g) in enumerate(_kept(want["steps"], got["steps"])):
        computed = computed and first_difference(w, g, exact=True) is None
        assert computed or bool(g.isnan().all()), (
            f"value {n}, made after the last flush that ran, is neither eager's nor NaN: {g}\n{loop!r}")


def _kept(want: list[dict], got: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(eager's, kept) for each tensor of the steps ``got`` kept, in the order the loop made them."""
    pairs = []
    for w, g in zip(want, got):
        for key in g:  # insertion order: the program's
            pairs += zip(w[key], g[key]) if key == "grads" else [(w[key], g[key])]
    return pairs


# -------------------------------------------------------------------------------------------------
# Reproducers: the smallest loops of each failure the generated tests found


def test_sgd_momentum_with_a_smaller_batch_compiled(fresh_regions):
    """The size-3 batch's exact key is served by the class's symbolic region (registered at its
    first run), but keeps the in-place flag of its own static program: from its second run, the
    compiled update of the parameters and momentum buffers is never written back (ISSUE12 item 1)."""
    net = Net("mlp", (("relu",),), 8, "squares")  # no integer targets: the step compiles in place
    loop = Loop((Trainee(net, Optim("SGD", (("lr", 0.1), ("momentum", 0.9))), 0),), sizes=((4, 1), (4, 1), (3, 1), (3, 1)))
    assert_training_matches_eager(loop, COMPILED)


def test_conv_net_in_channels_last(fresh_regions):
    """A pending channels_last conv output reports contiguous strides, so ``flatten`` makes a view
    where eager copies, and the classifier's backward fails at the flush (ISSUE12 item 6)."""
    net = Net("conv", (("relu",),), 4, "mse", adaptive=False, extent=2, channels_last=True)
    loop = Loop((Trainee(net, Optim("SGD", (("lr", 0.05),)), 0),), sizes=((2, 2),))
    assert_training_matches_eager(loop, REPLAY)


def test_ctrl_c_in_the_flush_of_an_optimizer_step():
    """KeyboardInterrupt in the flush of the first ``optimizer.step()``, caught by the program: the
    step's loss, pending in that window, must read NaN, not the placeholder's uninitialized memory
    (ISSUE12 item 4)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    kept = []
    with _InterruptedFlush(1), contextlib.suppress(KeyboardInterrupt):
        with adaptive_eager(**REPLAY):
            loss = F.mse_loss(model(x), y)
            kept.append(loss.detach())
            loss.backward()
            opt.step()  # the first flush
    assert len(kept) == 1 and opt.state_dict()["state"] == {}
    assert kept[0].isnan().all(), f"the interrupted step's loss reads {kept[0]}"


def test_logged_gradients_and_momentum_buffers_do_not_share_memory_compiled(fresh_regions):
    """The window after ``loss.item()`` clips the gradients, clones them for the log, and SGD's
    first step clones them again into its momentum buffers. Inductor merged the identical clones
    and the region returned one buffer for both outputs, so the next step's in-place momentum
    update rewrote the logged gradients (Note [Repeated outputs] in fuser.backends.inductor)."""
    net = Net("mlp", (("relu",),), 4, "squares")
    sgd = Optim("SGD", (("foreach", True), ("lr", 0.1), ("momentum", 0.9)))
    loop = Loop((Trainee(net, sgd, 0),), sizes=((3, 1),) * 2, clip=0.5, log_every=1)
    assert_training_matches_eager(loop, COMPILED)


def test_two_clones_of_one_value_are_two_tensors_compiled(fresh_regions):
    x = torch.randn(4)
    with adaptive_eager(**COMPILED):
        y = x * 2
        a, b = y.clone(), y.clone()
        del y
    assert ae.metrics()["compiled_runs"] == 1
    a.add_(1)
    torch.testing.assert_close(b, x * 2)


@pytest.mark.usefixtures("small_windows_off")
def test_mse_loss_backward_compiles_for_varying_batch_sizes(fresh_regions):
    """Found by the compiled loops (not a wrong value: the failed region was replayed, and every new
    batch size then compiled on its own). AOTAutograd's tensorify_python_scalars pass rewrites
    SymFloat arithmetic into tensor ops from the graph nodes that carry each symbol; the fuser's
    symbolic graph had none for its input dimensions, so the pass failed with KeyError: s<k>
    (Note [Symbols as inputs] in fuser.backends.inductor)."""
    w = torch.randn(3, 6, requires_grad=True)
    grads = {}
    with adaptive_eager(**COMPILED):
        for b in (2, 3):
            x, y = torch.randn(b, 6), torch.randn(b, 3)
            grads[b] = (x, y, torch.autograd.grad(F.mse_loss(x @ w.t(), y), w)[0])
            ae.sync()
    for x, y, g in grads.values():
        torch.testing.assert_close(g, torch.autograd.grad(F.mse_loss(x @ w.t(), y), w)[0])
    m = ae.metrics()
    assert m["recompiles"].get("dynamic") == 1 and m["compile_failures"] == 0, m


@pytest.mark.parametrize("loss", [F.smooth_l1_loss, F.huber_loss, F.l1_loss], ids=lambda f: f.__name__)
@pytest.mark.usefixtures("small_windows_off")
def test_a_loss_of_the_mean_compiles_one_symbolic_region(fresh_regions, loss):
    """smooth_l1 and huber's backwards, like mse's, scale by a float of the batch size (Note [Symbols
    as inputs] in fuser.backends.inductor); l1's by an int, for comparison."""
    w = torch.randn(3, 6, requires_grad=True)
    grads = []
    with adaptive_eager(**COMPILED):
        for b in (2, 3, 5):
            x, y = torch.randn(b, 6), torch.randn(b, 3)
            grads.append((x, y, torch.autograd.grad(loss(x @ w.t(), y), w)[0]))
            ae.sync()
    for x, y, g in grads:
        torch.testing.assert_close(g, torch.autograd.grad(loss(x @ w.t(), y), w)[0])
    m = ae.metrics()
    assert m["recompiles"].get("dynamic") == 1 and m["compile_failures"] == 0, m


def test_a_regression_loop_over_varying_batch_sizes_compiles_one_symbolic_region(fresh_regions):
    """An MSE regression trained with SGD on batches of several sizes (a bucketing sampler, a smaller
    last batch): the backward's region is compiled once, symbolic in the batch (Note [Symbols as
    inputs] in fuser.backends.inductor), with eager's parameters at the end."""
    def train(lazy):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        batches = [(torch.randn(b, 6), torch.randn(b, 2)) for b in (8, 8, 3, 8, 5, 6)]
        with adaptive_eager(**COMPILED) if lazy else contextlib.nullcontext():
            for x, y in batches:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
                ae.sync()
        return [p.detach() for p in model.parameters()]

    for got, want in zip(train(True), train(False)):
        torch.testing.assert_close(got, want)
    m = ae.metrics()
    assert m["compile_failures"] == 0 and m["blacklisted"] == 0, m
    assert m["recompiles"].get("dynamic", 0) >= 1, m


class _Cycle:
    """An object only a reference cycle keeps alive: it lives until the garbage collector runs."""

    def __init__(self, value):
        self.value, self.me = value, self


def test_a_value_freed_by_the_garbage_collector_during_its_flush(monkeypatch):
    """Liveness is read at the start of a flush; a value held only by a garbage cycle dies when
    the collector runs during the flush, and binding it must not fail (Note [Liveness during a
    flush]). Found by the compiled loops: the failure blacklisted an in-place region after it had
    updated the parameters, and its replay updated them a second time."""
    replay = fuser.replay_window

    def collecting(window):
        gc.collect()  # the collector runs inside the flush (any allocation may trigger it)
        return replay(window)

    monkeypatch.setattr(fuser, "replay_window", collecting)
    x = torch.randn(4)
    with adaptive_eager(**REPLAY):
        y = x * 2
        _Cycle(y + 1)  # pending, and garbage already
        z = y.sum()
    assert torch.equal(z, (x * 2).sum())
    assert ae.metrics()["ops_recorded"] == 3


def test_an_in_place_region_whose_output_the_collector_frees_updates_parameters_once(monkeypatch, fresh_regions, windows_not_captured):
    """The compiled form of the test above: the region that writes the parameters in place is
    compiled at first sight, between the flush's liveness read and its outputs' binding."""
    from fuser.backends import get_backend

    backend_class = type(get_backend("inductor", "cpu"))
    compile_window = backend_class.compile

    def collecting(self, gm, inputs):
        gc.collect()
        return compile_window(self, gm, inputs)

    monkeypatch.setattr(backend_class, "compile", collecting)  # the class: no instance attribute left behind
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(3, 4), torch.randn(3, 2)

    def step(net):
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        loss = F.mse_loss(net(x), y)
        loss.backward()
        _Cycle(loss * 2)
        opt.step()
        return loss.detach()

    # two steps: the first window views the parameters and then writes them, and replays
    # (Note [Views of unwritten memory] in adaptive_eager._record); the second compiles
    with adaptive_eager(**COMPILED):
        step(model)
        got = step(model)
    m = ae.metrics()
    step(reference)
    want = step(reference)
    torch.testing.assert_close(got, want)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)  # not updated twice
    assert m["compiles"] >= 1 and m["blacklisted"] == 0, m
