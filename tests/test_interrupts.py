"""A signal during a transactional load (Ctrl-C, a SIGTERM handler that raises) is rolled
back like any other exception, however close it comes to a compiled write."""

from __future__ import annotations

import signal
import threading

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch, inspect_load, native
from patchkit.toymodels import PlainModel

SHAPES = {"a": (64, 64), "b": (64, 64)}


def _patches(kind: str) -> list[CheckpointWeightPatch]:
    n = 64 * 64
    if kind == "dense":
        return [CheckpointWeightPatch(k, s, torch.float32, torch.ones(n))
                for k, s in SHAPES.items()]
    idx = torch.arange(0, n, 2)
    return [CheckpointWeightPatch(k, s, torch.float32, torch.ones(idx.numel()), idx)
            for k, s in SHAPES.items()]


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for each test, as an interactive
    run has: a process started in the background of a shell script, or under some
    runners, inherits SIGINT ignored, and these tests raise it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def compiled():
    if not native.status().startswith("compiled"):
        pytest.skip(f"the compiled path is off here: {native.status()}")


def _signal_after_the_first(monkeypatch, name: str, sig: int = signal.SIGINT) -> list[int]:
    """``native.<name>`` raises ``sig`` in this thread right after its first C call
    returns: the signal's Python handler runs at the next bytecode, inside this wrapper,
    after the write and before its save is registered."""
    real = getattr(native, name)
    calls = []

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1 and out is not None:
            signal.raise_signal(sig)
        return out

    monkeypatch.setattr(native, name, wrapper)
    return calls


@pytest.mark.parametrize("run", ["load", "inspect_load"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_ctrl_c_right_after_a_compiled_write_is_rolled_back(compiled, monkeypatch, kind, run):
    calls = _signal_after_the_first(monkeypatch, "_compare_copy" if kind == "dense" else "merge")
    m = PlainModel(SHAPES, dtype=torch.float32)
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()}
    load = patchkit.load_checkpoint_weight_patches if run == "load" else inspect_load
    with pytest.raises(KeyboardInterrupt) as e:
        load(m, _patches(kind), transactional=True)
    assert calls  # (the compiled path wrote)
    for name, p in m.named_parameters():
        assert int(p.count_nonzero()) == 0, name  # every write put back
    if run == "inspect_load":
        report = e.value.report
        assert report.rolled_back and len(report.writes) == 1  # the write is on record
    assert {s: signal.getsignal(s) for s in signal.valid_signals()} == handlers


def test_a_handler_that_does_not_raise_runs_once_after_the_write(compiled, monkeypatch):
    from patchkit.intercept import WriteSession

    events = []
    real_copy, real_record = native._compare_copy, WriteSession._record

    def compare_copy(*args, **kwargs):
        out = real_copy(*args, **kwargs)
        events.append("copied")
        if events.count("copied") == 1:
            signal.raise_signal(signal.SIGUSR1)
        return out

    def record(self, *args, **kwargs):
        events.append("recorded")
        return real_record(self, *args, **kwargs)

    monkeypatch.setattr(native, "_compare_copy", compare_copy)
    monkeypatch.setattr(WriteSession, "_record", record)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: events.append("handler"))
    try:
        m = PlainModel(SHAPES, dtype=torch.float32)
        r = inspect_load(m, _patches("dense"), transactional=True)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # the handler ran once, after the write it interrupted was saved and recorded
    assert events == ["copied", "recorded", "handler", "copied", "recorded"]
    assert r.error is None and len(r.writes) == 2
    assert all(bool((p == 1).all()) for p in m.parameters())


def test_a_handler_set_during_a_load_that_calls_the_one_it_found_keeps_working():
    # (a library set up inside load_weights chains to the handler it finds: the
    # deferral's own, which must pass the signal on after the load too)
    chained = []

    class SetsAHandler(PlainModel):
        def load_weights(self, weights):
            found = signal.getsignal(signal.SIGINT)

            def cleanup_then_previous(signum, frame):
                chained.append(signum)
                found(signum, frame)

            signal.signal(signal.SIGINT, cleanup_then_previous)
            return super().load_weights(weights)

    m = SetsAHandler(SHAPES, dtype=torch.float32)
    try:
        patchkit.load_checkpoint_weight_patches(m, _patches("dense"), transactional=True)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
            for _ in range(100):  # (the handler runs at one of these bytecodes)
                pass
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert chained == [signal.SIGINT]


def test_two_signals_held_back_both_run_when_the_first_raises(compiled, monkeypatch):
    ran = []
    real = native._compare_copy

    def compare_copy(*args, **kwargs):
        out = real(*args, **kwargs)
        if not ran:
            ran.append("copied")
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGUSR1)
        return out

    monkeypatch.setattr(native, "_compare_copy", compare_copy)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: ran.append("USR1"))
    try:
        m = PlainModel(SHAPES, dtype=torch.float32)
        with pytest.raises(KeyboardInterrupt):
            patchkit.load_checkpoint_weight_patches(m, _patches("dense"), transactional=True)
        for _ in range(100):  # (where the second one runs, if it was not run yet)
            pass
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert ran == ["copied", "USR1"]
    assert all(int(p.count_nonzero()) == 0 for p in m.parameters())


def _sigint_seen_by_a_load(on_thread: bool) -> list:
    """SIGINT's handler as a transactional load's ``load_weights`` sees it, the load run
    on this thread or on another one."""
    seen = []

    class Watching(PlainModel):
        def load_weights(self, weights):
            seen.append(signal.getsignal(signal.SIGINT))
            return super().load_weights(weights)

    def load():
        m = Watching(SHAPES, dtype=torch.float32)
        patchkit.load_checkpoint_weight_patches(m, _patches("dense"), transactional=True)

    if on_thread:
        t = threading.Thread(target=load)
        t.start()
        t.join()
    else:
        load()
    return seen


def test_a_load_on_another_thread_leaves_the_handlers_alone(compiled):
    assert _sigint_seen_by_a_load(on_thread=True) == [signal.default_int_handler]
    (during,) = _sigint_seen_by_a_load(on_thread=False)  # (taken over on this one)
    assert during is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_waits_for_the_rollback(monkeypatch):
    from patchkit.intercept import WriteSession

    class Fails(PlainModel):
        def load_weights(self, weights):
            for name, w in weights:
                self.get_parameter(name).data.copy_(w)
            raise ValueError("the loader failed after writing")

    real = WriteSession.restore

    def interrupted_restore(self):
        signal.raise_signal(signal.SIGINT)  # (its handler would run at the next bytecode)
        real(self)

    monkeypatch.setattr(WriteSession, "restore", interrupted_restore)
    m = Fails(SHAPES, dtype=torch.float32)
    with pytest.raises(KeyboardInterrupt) as e:
        patchkit.load_checkpoint_weight_patches(m, _patches("dense"), transactional=True)
    assert isinstance(e.value.__context__, ValueError)  # (raised once the rollback ended)
    for name, p in m.named_parameters():
        assert int(p.count_nonzero()) == 0, name
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _signal_around(monkeypatch, module, name: str, *, after: bool) -> None:
    """``module.<name>`` raises SIGINT in this thread as it is called, or as it returns
    (a Ctrl-C that comes at that moment), the first time."""
    real = getattr(module, name)
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if not after and len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        out = real(*args, **kwargs)
        if after and len(calls) == 1:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(module, name, wrapper)


@pytest.mark.parametrize("when", ["as the load returns", "while the report is made"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_ctrl_c_after_a_transactional_reports_last_call_rolls_it_back(monkeypatch, kind, when):
    # (was: the model kept the new weights, with no report, or with one that said
    # ``rolled_back`` though nothing had been put back)
    import patchkit.inspect as pk_inspect

    if when == "as the load returns":
        _signal_around(monkeypatch, pk_inspect, "run_load", after=True)
    else:
        _signal_around(monkeypatch, pk_inspect, "_report_of", after=False)
    m = PlainModel(SHAPES, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()}
    with pytest.raises(KeyboardInterrupt) as e:
        inspect_load(m, _patches(kind), transactional=True, max_chunk_bytes=1)
    report = e.value.report
    assert report.rolled_back and report.error is e.value
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert report.summary()["names loaded"] == 0
    assert len(report.calls) == 2 and len(report.writes) == 2  # the load had ended
    assert handlers == {s: signal.getsignal(s) for s in signal.valid_signals()}


def test_ctrl_c_after_a_transactional_loads_last_call_rolls_it_back(monkeypatch):
    import patchkit.loader as pk_loader

    # (the load's last step before it lets its saves go: ``holding`` for the discard)
    _signal_around(monkeypatch, pk_loader._DEFERRAL, "holding", after=False)
    m = PlainModel(SHAPES, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    with pytest.raises(KeyboardInterrupt):
        patchkit.load_checkpoint_weight_patches(m, _patches("dense"), transactional=True,
                                                max_chunk_bytes=1)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_a_signal_while_a_handler_runs_during_a_load_reaches_that_handler_again():
    # (a slow SIGTERM handler that gets a second SIGTERM: during a load the second was
    # taken for a handler calling on to the one it found, and dropped)
    calls = []

    def on_term(signum, frame):
        calls.append(signum)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGTERM)  # the second, while this one runs

    class TermDuringLoad(PlainModel):
        def load_weights(self, weights):
            signal.raise_signal(signal.SIGTERM)
            return super().load_weights(weights)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        patchkit.load_checkpoint_weight_patches(
            TermDuringLoad(SHAPES, dtype=torch.float32), _patches("dense"),
            transactional=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [signal.SIGTERM, signal.SIGTERM]


def test_handlers_taken_over_step_after_step_are_not_all_kept():
    # (a trainer that sets a fresh closure as its handler every step kept each one, and
    # what it referenced, for the life of the process)
    import gc
    import weakref

    from patchkit.intercept import _DEFERRAL, _KNOWN

    class Step:
        pass

    alive = []
    previous = signal.getsignal(signal.SIGTERM)
    try:
        for _ in range(3 * _KNOWN):
            step = Step()
            alive.append(weakref.ref(step))
            signal.signal(signal.SIGTERM, lambda s, f, step=step: None)
            del step
            patchkit.load_checkpoint_weight_patches(
                PlainModel(SHAPES, dtype=torch.float32), _patches("dense"), transactional=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    gc.collect()
    assert sum(r() is not None for r in alive) <= _KNOWN + 1
    assert len(_DEFERRAL._known[signal.SIGTERM]) <= _KNOWN


def test_a_transactional_report_of_no_patches_lets_a_ctrl_c_through(monkeypatch):
    # (it held the signal, then failed to roll back a load that made no session, and
    # raised that ValueError in place of the KeyboardInterrupt)
    import patchkit.inspect as pk_inspect

    _signal_around(monkeypatch, pk_inspect, "_report_of", after=False)
    with pytest.raises(KeyboardInterrupt):
        inspect_load(PlainModel(SHAPES, dtype=torch.float32), [], transactional=True)


def test_a_failure_to_close_the_progress_view_leaves_no_signal_held(monkeypatch):
    # (a transactional report kept holding every signal while the exception lived: a
    # Ctrl-C in a notebook that kept the traceback did nothing)
    import patchkit.inspect as pk_inspect
    from patchkit.intercept import _DEFERRAL

    def broken_close(self, failed=False):
        raise RuntimeError("the progress view could not close")

    monkeypatch.setattr(pk_inspect.Tracker, "close", broken_close)
    with pytest.raises(RuntimeError, match="could not close") as e:
        inspect_load(PlainModel(SHAPES, dtype=torch.float32), _patches("dense"),
                     transactional=True, progress=lambda _: None)
    assert (_DEFERRAL.depth, _DEFERRAL._uses) == (0, 0)
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    del e


@pytest.mark.parametrize("forks", ["another thread", "the load's thread"])
def test_a_child_forked_while_a_load_holds_signals_back_gets_its_ctrl_c(forks):
    # (was: a child forked by another thread while the main thread's load was mid-write
    # kept the load's hold, which no thread of the child ever let go: every Ctrl-C, and
    # every signal a Python handler stops it with, was held back for good; a child of
    # the load's own thread goes on with that load, and gets its Ctrl-C where it ends)
    import contextlib
    import os
    import time
    import warnings

    from patchkit.intercept import _DEFERRAL

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    pids = []
    hold = contextlib.ExitStack()

    def fork():
        with warnings.catch_warnings():  # (3.12: "multi-threaded, use of fork()")
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit status 3 when its Ctrl-C reached it where it should
            code, held = 1, False
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(30)  # (a child that hangs dies of it)
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.2)  # (Python runs the handler by now, unless held back)
                    held = True
                    if forks == "the load's thread":
                        hold.close()  # (the load ends: what it held back runs)
                    code = 2
                except KeyboardInterrupt:
                    code = 3 if held == (forks == "the load's thread") else 4
                if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                    code = 5
            finally:
                os._exit(code)
        pids.append(pid)

    hold.enter_context(_DEFERRAL.holding())  # (what a load does around a write's save)
    try:
        if forks == "another thread":
            thread = threading.Thread(target=fork)
            thread.start()
            thread.join(30)
        else:
            fork()
    finally:
        hold.close()
    (pid,) = pids
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3  # (2: held back for good; -14: it hung)


def test_a_child_forked_by_another_thread_mid_hold_holds_and_lets_go_as_a_fresh_process():
    # The child's own holds after such a fork: a Ctrl-C during one reaches it at its end,
    # and the parent's Ctrl-C, held back at the fork, never does (mutation testing: a
    # child that kept the parent's hold depth swallowed its own Ctrl-C for good, and one
    # that kept what the parent held back got the parent's Ctrl-C at its first hold's end;
    # both passed every test)
    import os
    import time
    import warnings

    from patchkit.intercept import _DEFERRAL

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    pids = []

    def fork():
        with warnings.catch_warnings():  # (3.12: "multi-threaded, use of fork()")
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit status 3 when both holds behaved
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(30)  # (a child that hangs dies of it)
                try:
                    with _DEFERRAL.holding():
                        pass
                except KeyboardInterrupt:
                    code = 4  # (the parent's Ctrl-C)
                else:
                    try:
                        with _DEFERRAL.holding():
                            os.kill(os.getpid(), signal.SIGINT)
                            time.sleep(0.2)  # (Python runs the handler by now: held back)
                        code = 2  # (swallowed)
                    except KeyboardInterrupt:
                        code = 3
            finally:
                os._exit(code)
        pids.append(pid)

    # (the parent's Ctrl-C, let go where its hold ends)
    with pytest.raises(KeyboardInterrupt), _DEFERRAL.holding():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        assert _DEFERRAL._pending == [signal.SIGINT]
        thread = threading.Thread(target=fork)
        thread.start()
        thread.join(30)
    (pid,) = pids
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3  # (2: swallowed, 4: the parent's)
