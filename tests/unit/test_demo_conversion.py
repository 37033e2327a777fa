"""The demo target's conversion cache (``demo_model.py``): processes and threads that convert the
same checkpoint at once (test workers, a server and a bench started together) convert it once."""

import threading
import time

import specfw.demo_model as demo_model


def test_concurrent_conversions_of_one_checkpoint_convert_once(tmp_path, monkeypatch):
    calls = []

    def slow_convert(gguf, out, eos_token):  # the real one dequantises for seconds
        calls.append(out)
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / "specfw_converted.json").write_text("{}")
        return out

    monkeypatch.setattr(demo_model, "_convert", slow_convert)
    out = tmp_path / "models" / "m"
    results = []
    threads = [threading.Thread(target=lambda: results.append(demo_model.convert_gguf(tmp_path / "m.gguf", out))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [out] * 3 and calls == [out]  # the later callers waited and found it done
    assert demo_model.is_converted(out)
