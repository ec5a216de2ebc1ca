"""cuBLAS's algorithm choice per GEMM shape (runtime/devices/cuda/cublas.py), checked without a
GPU: what is timed when, what is stored, and that a later process reads the same choice back
without timing. The timing itself and cuBLASLt's calls run on the GPU machine
(bench/h200_gemm_algos.py)."""
import json

import pytest

from lorac.runtime.devices.cuda import cublas

ALGO = bytes(range(64))


class _Shape:
    """cublaslt.Shape's stand-in: two candidates, the second ALGO."""
    made = 0

    def __init__(self, plan, count):
        _Shape.made += 1
        self.algos = [type("R", (), {"algo": bytes(64)})(), type("R", (), {"algo": ALGO})()]
        self.ran = []

    def run(self, i, a, b, out, beta, workspace, stream):
        self.ran.append(i)


class _T:
    def __init__(self, shape, dtype="bfloat16"):
        self.shape, self.dtype = shape, dtype
        self.device = type("D", (), {"index": 0})()

    def data_ptr(self):
        return 0


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    from lorac.runtime.devices.cuda import cublaslt
    monkeypatch.delenv("LORAC_CUDA_GEMM", raising=False)
    monkeypatch.setattr(cublaslt, "Shape", _Shape)
    monkeypatch.setattr(cublas, "_handle", object())
    monkeypatch.setattr(cublas, "_get_stream", lambda kind, index: None)
    monkeypatch.setattr(cublas, "_stream", [None])
    monkeypatch.setattr(cublas, "_lt_workspace", lambda: 0)
    monkeypatch.setattr(cublas, "_resolved", {})
    calls = {"ex": 0, "timed": 0}
    monkeypatch.setattr(cublas, "_gemm_ex", lambda *a: calls.__setitem__("ex", calls["ex"] + 1))
    store = cublas.Choices("cuda-gemm.json", decode=cublas._decode)
    store.configure("Test GPU; cuBLAS 1")
    store.set_file(tmp_path)
    monkeypatch.setattr(cublas, "_store", store)
    return calls


def _time_picks(result, calls):
    def fake_time(plan, accumulate, a, b, out, stream):
        calls["timed"] += 1
        if result is None:
            return None
        shape = _Shape(plan, 8)
        return shape, result
    return fake_time


def test_first_call_outside_a_capture_is_timed_and_stored(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(cublas, "_capturing", lambda stream: False)
    monkeypatch.setattr(cublas, "_time", _time_picks(1, fake_cuda))
    a, b, out = _T((64, 32)), _T((48, 32)), _T((64, 48))
    for _ in range(3):
        cublas.gemm(False, True, a, b, out)
    assert fake_cuda["timed"] == 1 and fake_cuda["ex"] == 0  # timed once, then the winner runs
    saved = json.loads((tmp_path / "cuda-gemm.json").read_text())["Test GPU; cuBLAS 1"]
    assert saved == {"nt 64x32 48x32 bfloat16,bfloat16->bfloat16": "lt:" + ALGO.hex()}
    cublas.gemm(False, True, a, b, out, accumulate=True)  # another key: an accumulating call is timed apart
    assert fake_cuda["timed"] == 2


def test_inside_a_capture_nothing_is_timed_or_stored(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(cublas, "_capturing", lambda stream: True)
    monkeypatch.setattr(cublas, "_time", _time_picks(1, fake_cuda))
    cublas.gemm(False, False, _T((8, 8)), _T((8, 8)), _T((8, 8)))
    assert fake_cuda == {"ex": 1, "timed": 0} and not (tmp_path / "cuda-gemm.json").exists()
    monkeypatch.setattr(cublas, "_capturing", lambda stream: False)  # the next call outside one is timed
    cublas.gemm(False, False, _T((8, 8)), _T((8, 8)), _T((8, 8)))
    assert fake_cuda["timed"] == 1


def test_cublas_own_pick_is_stored_too(fake_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(cublas, "_capturing", lambda stream: False)
    monkeypatch.setattr(cublas, "_time", _time_picks(None, fake_cuda))
    cublas.gemm(True, False, _T((16, 8)), _T((16, 4)), _T((8, 4), "float32"))
    assert fake_cuda == {"ex": 1, "timed": 1}
    saved = json.loads((tmp_path / "cuda-gemm.json").read_text())["Test GPU; cuBLAS 1"]
    assert saved == {"tn 16x8 16x4 bfloat16,bfloat16->float32": "default"}


def test_stored_choice_is_used_without_timing(fake_cuda, monkeypatch, tmp_path):
    key = "nn 8x8 8x8 bfloat16,bfloat16->bfloat16"
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "cuda-gemm.json").write_text(json.dumps({"Test GPU; cuBLAS 1": {key: "lt:" + ALGO.hex()},
                                                               "Other GPU; cuBLAS 1": {key: "default"}}))
    cublas._store.set_file(tmp_path / "x")
    monkeypatch.setattr(cublas, "_time", _time_picks(0, fake_cuda))
    monkeypatch.setattr(cublas, "_capturing", lambda stream: True)  # even inside a capture
    cublas.gemm(False, False, _T((8, 8)), _T((8, 8)), _T((8, 8)))
    run = cublas._resolved[(False, False, (8, 8), (8, 8), (8, 8), "bfloat16", "bfloat16", "bfloat16", False)]
    assert fake_cuda["timed"] == 0 and run[1] == 1 and run[0].ran == [1]


def test_stale_or_foreign_values_are_timed_anew(fake_cuda, monkeypatch, tmp_path):
    key = "nn 8x8 8x8 bfloat16,bfloat16->bfloat16"
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "cuda-gemm.json").write_text(json.dumps({"Test GPU; cuBLAS 1": {key: "lt:" + "ab" * 64}}))
    cublas._store.set_file(tmp_path / "y")
    monkeypatch.setattr(cublas, "_capturing", lambda stream: False)
    monkeypatch.setattr(cublas, "_time", _time_picks(None, fake_cuda))
    cublas.gemm(False, False, _T((8, 8)), _T((8, 8)), _T((8, 8)))  # the heuristic no longer lists it
    assert fake_cuda["timed"] == 1
    assert cublas._decode("lt:12") is None and cublas._decode("fast") is None


def test_default_setting_never_times(fake_cuda, monkeypatch):
    monkeypatch.setenv("LORAC_CUDA_GEMM", "default")
    monkeypatch.setattr(cublas, "_capturing", lambda stream: False)
    monkeypatch.setattr(cublas, "_time", _time_picks(1, fake_cuda))
    cublas.gemm(False, False, _T((8, 8)), _T((8, 8)), _T((8, 8)))
    assert fake_cuda == {"ex": 1, "timed": 0}
