"""A learning-rate schedule is honoured on every backend: a data-parallel loop that steps a
``StepDecay`` (and a ``LinearWarmup`` over a ``CosineAnnealingDecay``) after every step, as one
does with Paddle's static Executor, equals the serial loop stepping it — losses every step,
parameters at the end. Before, every step trained at the initial rate, silently (the runtimes
ran clones of the program, which Paddle's executor never saw as the scheduled program)."""

import textwrap

import pytest

from autopar.testing.processes import launch

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import numpy as np, paddle
    import autopar

    def check(backend, kind):
        paddle.enable_static()
        main, startup = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, startup):
            x = paddle.static.data("x", [6, 10], "float32")
            y = paddle.static.data("y", [6, 1], "int64")
            loss = paddle.mean(paddle.nn.functional.cross_entropy(paddle.nn.Linear(10, 7)(x), y))
            if kind == "step":
                schedule = paddle.optimizer.lr.StepDecay(0.5, step_size=1, gamma=0.3)
            else:
                schedule = paddle.optimizer.lr.LinearWarmup(paddle.optimizer.lr.CosineAnnealingDecay(0.4, T_max=5), 2, 0.0, 0.4)
            paddle.optimizer.Momentum(schedule, momentum=0.9).minimize(loss)
        mesh = autopar.ProcessMesh([0, 1], ["dp"])
        autopar.shard_tensor(x, mesh, ["dp", None])
        dist = autopar.compile(main, mesh, startup_program=startup)
        rng = np.random.default_rng(4)
        feeds = [{"x": rng.standard_normal((6, 10)).astype("float32"), "y": rng.integers(0, 7, (6, 1)).astype("int64")} for _ in range(5)]
        begin = schedule.state_dict()

        paddle.seed(9)
        scope, exe = paddle.static.Scope(), paddle.static.Executor(paddle.CPUPlace())
        serial = []
        with paddle.static.scope_guard(scope):
            exe.run(startup)
            for feed in feeds:
                serial.append(float(exe.run(main, feed=feed, fetch_list=[loss])[0]))
                schedule.step()
        params = {n: np.array(scope.find_var(n).get_tensor()) for n in dist.values.named("parameter")}

        schedule.set_state_dict(begin)
        paddle.seed(9)
        dist_exe = autopar.Executor(dist, backend=backend)
        dist_exe.run_startup()
        losses = []
        for feed in feeds:
            losses.append(float(dist_exe.run(feed, fetch_list=[loss])[0]))
            schedule.step()
        np.testing.assert_allclose(losses, serial, rtol=1e-5)
        got = dist_exe.parameters()
        for name, want in params.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        print("RESULT equal", dist_exe.backend, kind, flush=True)

    # host before native, both schedules, in one launch (a launch costs ~1.5 s a process)
    for case in sys.argv[1:]:
        check(*case.split(":"))
    """
)


def test_a_stepped_schedule_equals_serial(tmp_path):
    cases = [(backend, kind) for backend in ("host", "native") for kind in ("step", "warmup-cosine")]
    results = launch(SCRIPT, 2, tmp_path, [f"{backend}:{kind}" for backend, kind in cases], timeout=300)
    for backend, kind in cases:
        assert sum(f"RESULT equal {backend} {kind}" in line for line in results) == 2, (backend, kind, results)
