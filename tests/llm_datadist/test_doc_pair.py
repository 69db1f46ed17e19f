"""docs/llm_datadist.md's pair in full: its prefill and decode snippets run unchanged as two
processes (``import llm_datadist`` being kvdd's simulator, as after ``source set_env.sh``), and
decode ends with exactly the blocks it pulled written, every other byte untouched."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from demo_support import child_env
from engine_support import free_port

DOC = Path(__file__).resolve().parents[2] / "docs" / "llm_datadist.md"
DOC_PORT = "26000"
BOOT = "import kvdd.llm_datadist.toplevel as _kvdd_top\n_kvdd_top.install()\n"
# After the decode snippet: tensor t of the prefill holds t everywhere; decode pulled its blocks
# 3, 4, 9 into 0, 1, 2 (all layers) and into 5, 6, 7 (layer by layer); nothing else is written.
CHECK = """
for t, a in enumerate(kv):
    assert (a[[0, 1, 2, 5, 6, 7]] == t).all(), t
    assert not a[[3, 4]].any() and not a[8:].any(), t
print("decode: every byte right")
"""


def _snippets() -> tuple[str, str]:
    text = DOC.read_text(encoding="utf-8")
    pair = text[text.index("A pair in full."):]
    blocks = re.findall(r"```python\n(.*?)```", pair, flags=re.S)
    return blocks[0], blocks[1]


def test_the_docs_prefill_and_decode_snippets_run_as_two_processes() -> None:
    prefill, decode = _snippets()
    assert DOC_PORT in prefill and DOC_PORT in decode
    port = str(free_port())
    env = child_env()
    server = subprocess.Popen([sys.executable, "-c", BOOT + prefill.replace(DOC_PORT, port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert server.stdout is not None
        ready = server.stdout.readline()  # input()'s prompt: registered and listening
        assert ready.startswith("serving"), ready + server.communicate(timeout=30)[1]
        client = subprocess.run([sys.executable, "-c", BOOT + decode.replace(DOC_PORT, port) + CHECK],
                                capture_output=True, text=True, env=env, timeout=120)
        assert client.returncode == 0, client.stdout + client.stderr
        assert "decode: every byte right" in client.stdout
        out, err = server.communicate("\n", timeout=60)
        assert server.returncode == 0, out + err
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
