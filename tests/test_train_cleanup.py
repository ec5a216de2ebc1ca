"""train() closes what it opened and restores what it changed however the run ends: the
metrics file, the Ctrl-C/SIGTERM/SIGHUP handlers, the output directory's lock. The run here
is a stand-in (no model, no compile) whose first eval fails, after the handlers are in."""
from __future__ import annotations

import signal

import pytest

from lorac.runtime.train import loop as tr
from lorac.runtime.dist import Single


class _Engine:
    lora, log = {}, None

    def set_state(self, lora, m, v):
        pass


class _Data:
    def batches(self, batch, seed, state):
        return iter(())


class _FailingRun:
    tokenizer = eval_path = None

    def __init__(self, cfg, log):
        self.cfg, self.log, self.dp, self.data, self.engine = cfg, lambda m: None, Single(), _Data(), _Engine()

    def fresh_state(self):
        return dict(step=0, updates=0, skipped=0, lora={}, m={}, v={}, data=None, rng=None)

    def evaluate(self, lora):
        raise RuntimeError("eval failed")


def test_a_failing_run_closes_its_metrics_and_restores_the_signal_handlers(tmp_path, monkeypatch):
    reports = []

    class Report(tr.Report):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            reports.append(self)

    monkeypatch.setattr(tr, "Run", _FailingRun)
    monkeypatch.setattr(tr, "Report", Report)
    monkeypatch.setattr(tr, "compile_all", lambda *a: None)
    monkeypatch.setattr(tr, "graph_kinds", lambda *a: [])
    mine = lambda n, f: None  # noqa: E731 - a handler of the caller's, to be given back
    before = {sig: signal.signal(sig, mine) for sig in tr.STOP_SIGNALS}
    try:
        cfg = tr.TrainConfig(out=str(tmp_path / "out"), progress="lines", eval_batches=1)
        with pytest.raises(RuntimeError, match="eval failed"):
            tr.train(cfg)
        assert all(signal.getsignal(sig) is mine for sig in tr.STOP_SIGNALS)
        assert len(reports) == 1 and reports[0].metrics.closed
        assert tr._claim(tmp_path / "out") is not None  # the lock was released too
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
