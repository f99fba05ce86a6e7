"""Would an NVMe tier for the optimizer states keep the GPU busy? The disk's bandwidth, measured, against the step.

An NVMe tier (ZeRO-Infinity's) keeps the Adam moments on disk: every optimizer step reads each parameter's moments
and writes them back, so a step needs ``2 x moments bytes / disk bandwidth`` seconds of disk at least, overlapped at
best with the whole step. This script measures the disk the way such a tier would use it (large aligned blocks,
``O_DIRECT`` past the page cache where the file system takes it, several threads in flight) and puts that time
beside the planner's step for the full-depth models of docs/scale.md (one H200, 16 cores, a 1.5 TiB host, 8 x 4,096
tokens, ``benchmarks/scale_plan.py``'s engine options):

    python benchmarks/nvme_tier.py --dir /path/on/the/nvme --gib 16     # the device: the disk its tree lives on
    python benchmarks/nvme_tier.py --dry-run                             # CPU: 64 MiB in a temp folder, the code path

The moments' bytes per parameter are the host state layouts' (optim/compact_adam.py ``HostStateLayout``): 8 for fp32
moments, 2.03 for the 8-bit ones with their block scales. The file is written once (timed up to its ``fsync``),
then read; it is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 2**20


def _open(path: Path, write: bool) -> tuple[int, bool]:
    """A descriptor of ``path`` with O_DIRECT where the file system takes it (tmpfs does not), and whether it has."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError:
        return os.open(path, flags, 0o600), False


def bandwidth(path: Path, gib: float, block_mib: int, threads: int) -> dict:
    """Write then read ``gib`` GiB at ``path`` in blocks of ``block_mib`` MiB, ``threads`` blocks in flight (each
    thread its own page-aligned buffer, as O_DIRECT needs); GB/s (1e9 B/s) of each, fsync included."""
    block = block_mib * MIB
    blocks = max(threads, int(gib * 1024 // block_mib))
    buffers = [mmap.mmap(-1, block) for _ in range(threads)]  # anonymous maps are page-aligned
    for b in buffers:
        b.write(os.urandom(block))  # incompressible: no drive or file system may shortcut them
        b.seek(0)

    def run(write: bool) -> tuple[float, bool]:
        fd, direct = _open(path, write)
        io = os.pwrite if write else os.preadv

        def work(t: int) -> int:
            done = 0
            for k in range(t, blocks, threads):
                if write:
                    done += io(fd, buffers[t], k * block)
                else:
                    done += io(fd, [buffers[t]], k * block)
            return done

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            moved = sum(pool.map(work, range(threads)))
        if write:
            os.fsync(fd)
        seconds = time.perf_counter() - start
        os.close(fd)
        assert moved == blocks * block, f"moved {moved} of {blocks * block} bytes"
        return moved / seconds / 1e9, direct

    write_gbps, direct = run(write=True)
    read_gbps, _ = run(write=False)
    path.unlink()
    if not direct:
        print(f"WARNING: {path.parent} takes no O_DIRECT: the reads may come from the page cache, not the disk",
              file=sys.stderr)
    return {"bytes": blocks * block, "block_mib": block_mib, "threads": threads, "o_direct": direct,
            "write_gbps": write_gbps, "read_gbps": read_gbps}


def step_model(read_gbps: float, write_gbps: float) -> list[dict]:
    """Per full-depth model and host state: the moments' bytes, the disk seconds a step needs to read and write them
    once, the planner's step without the tier, and their ratio (> 1: the disk, not the GPU, sets the step)."""
    from scale_plan import ENGINE, MICRO_BATCH, MODELS, SEQ, machine

    from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS
    from lightning_megatrain.planner import plan

    rows = []
    for name, model in MODELS.items():
        for state in ("fp32", "compact"):
            p = plan(model, seq_len=SEQ, micro_batch=MICRO_BATCH, config=ENGINE.replace(host_state=state),
                     host_state=state, machine=machine(1536))
            moments = HOST_STATE_LAYOUTS[state].bytes_per_param()["optimizer states"] * p.n_params
            disk_s = moments / (read_gbps * 1e9) + moments / (write_gbps * 1e9)
            rows.append({"model": name, "host_state": state, "moments_gb": moments / 1e9, "disk_s": disk_s,
                         "planned_step_s": p.time["step total"], "disk_over_step": disk_s / p.time["step total"],
                         "disk_gbps_to_match": 2 * moments / p.time["step total"] / 1e9})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="a folder on the disk to measure (default: the current folder)")
    ap.add_argument("--gib", type=float, default=16.0, help="file size, GiB (default 16: past the disk's cache)")
    ap.add_argument("--block-mib", type=int, default=16)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", help="write the JSON row here")
    ap.add_argument("--dry-run", action="store_true", help="64 MiB in a temporary folder: the code path")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp() if args.dry_run else args.dir or ".")
    measured = bandwidth(folder / "nvme-tier-probe.bin", 1 / 16 if args.dry_run else args.gib, args.block_mib,
                         args.threads)
    if args.dry_run:
        folder.rmdir()
    row = {"measured": measured, "dir": str(folder), "step_model": step_model(measured["read_gbps"],
                                                                             measured["write_gbps"])}
    print(json.dumps(row, indent=1))
    print(f"\ndisk: write {measured['write_gbps']:.2f} GB/s, read {measured['read_gbps']:.2f} GB/s "
          f"(O_DIRECT {measured['o_direct']}, {measured['bytes'] / 2**30:.1f} GiB)")
    print("| model | host_state | moments GB | disk s/step | planned step s | disk / step | GB/s to match |")
    print("|---|---|---|---|---|---|---|")
    for r in row["step_model"]:
        print(f"| {r['model']} | {r['host_state']} | {r['moments_gb']:.0f} | {r['disk_s']:.0f} | "
              f"{r['planned_step_s']:.1f} | {r['disk_over_step']:.1f}x | {r['disk_gbps_to_match']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
