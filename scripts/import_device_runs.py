"""Copy run-store runs recorded on the device machine (`workbench bench` there writes them under
/tmp/wbruns; scripts/gpu_run.sh returns them as wbruns.tgz) into data/runs/.

    .venv/bin/python scripts/import_device_runs.py data/gpu/run8_ahead/wbruns.tgz --commit d1b6aa9

--commit names the commit whose code ran (the device's copy of .git can lag behind the tree it
was sent, so the manifest's own git_commit may be stale; the one recorded is kept as
`device_git_commit`). Runs already in data/runs are skipped.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

from workbench.atomic import atomic_write_text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("--commit", required=True, help="the commit whose code ran on the device")
    ap.add_argument("--data-dir", type=Path, default=Path("data"))
    args = ap.parse_args()
    dest = args.data_dir / "runs"
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(args.archive) as tar:
            tar.extractall(tmp, filter="data")
        for run in sorted((Path(tmp) / "runs").iterdir()):
            target = dest / run.name
            if target.exists():
                print(f"{run.name}: already in {dest}")
                continue
            manifest = json.loads((run / "manifest.json").read_text())
            manifest["device_git_commit"] = manifest.get("git_commit")
            manifest["git_commit"] = args.commit
            manifest["imported_from"] = str(args.archive)
            target.mkdir(parents=True)
            for f in run.iterdir():
                if f.name != "manifest.json":
                    (target / f.name).write_bytes(f.read_bytes())
            atomic_write_text(target / "manifest.json", json.dumps(manifest, indent=2) + "\n")
            print(f"{run.name}: imported ({manifest['ablation']}, {manifest['hardware_id']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
