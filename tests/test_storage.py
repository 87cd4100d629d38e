"""A full disk or quota in the write paths that are not one atomic file: prepare.py's token shards
(numpy reports the short write with no errno) and the appended logs (metrics.jsonl,
samples.jsonl): one line naming the file, and nothing torn left behind."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from laplace.errors import storage_error
from train.rundir import append_line

# What ndarray.tofile raised when a 64 KiB tmpfs filled part-way through np.save of 100000
# uint16 (docs/LOG.md): an OSError with neither errno nor file name.
SHORT_WRITE = "import numpy.lib.format as fmt\n" \
              "def write_array(fp, array, **kw):\n" \
              "    fp.write(b'\\x93NUMPY' + array.tobytes()[:100])\n" \
              "    raise OSError(f'{array.size} requested and 50 written')\n" \
              "fmt.write_array = write_array\n"


def test_prepare_on_a_full_disk_is_one_line_and_leaves_no_torn_shard(tmp_path):
    out = tmp_path / "pydoc"
    code = (SHORT_WRITE + "import sys, runpy\n"
            f"sys.argv = ['prepare.py', 'source=pydoc', 'tokenizer=bytes', 'out={out}', 'progress=false']\n"
            "runpy.run_path('prepare.py', run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {out}/") and err[0].endswith(
        ".npy: short write: the disk is full or over quota; free space there, or write elsewhere "
        "(run_dir= / out=)"), p.stderr[-3000:]
    assert not list(out.rglob("*.npy")) and not list(out.rglob("*.tmp"))  # no shard, whole or torn
    assert storage_error(OSError("100000 requested and 32704 written")) is not None
    assert storage_error(OSError("unrelated")) is None


def test_an_appended_line_is_whole_or_absent(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_line(path, '{"step": 1}')
    real_write = os.write

    def full(fd, data):  # the disk fills part-way through the line
        real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as e:
        append_line(path, '{"step": 2, "loss": 1.0}')
    assert e.value.filename == str(path) and storage_error(e.value) is e.value
    monkeypatch.setattr(os, "write", real_write)
    append_line(path, '{"step": 2}')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
