"""Peak extra memory and time of chunked vs. naive log-prob + entropy from logits.

Run:  python benchmarks/logprob_entropy.py [--rows 2048] [--vocab 151936] [--dtype float32]
          [--chunk-sizes 1024,256] [--repeats 3] [--device cpu|cuda]

Compares ``rlaudit.algo.logprob.logprobs_from_logits(..., calc_entropy=True)`` with the naive
``log_softmax`` + ``gather`` + ``-(p * logp).sum(-1)``, forward only and forward+backward (the
loss is ``logp.sum() + entropy.sum()`` so both gradient paths run).

How memory is measured (each case in a fresh subprocess, so no case sees another's pages):

- CPU: PyTorch's CPU allocator does not cache; tensors this large are mmap'ed by glibc and given
  back to the OS when freed, so the process's resident set tracks live tensors. After the
  logits (and labels) exist, the script resets the kernel's peak-RSS counter
  (``echo 5 > /proc/self/clear_refs``, which sets ``VmHWM`` to the current RSS), runs the case
  once, and reads ``VmHWM`` again: *peak extra* = ``VmHWM - RSS before``. It is an upper bound
  on what the operation allocated (page granularity, the allocator's and interpreter's own
  pages included). Where ``clear_refs`` cannot be written, ``ru_maxrss`` is used and the result
  is flagged (it cannot see a peak below the setup's).
- CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` before the case (exact
  tensor bytes, the caching allocator's reserved-but-free memory excluded).

For forward+backward the gradient w.r.t. the logits (as large as the logits, and produced by
both methods) is part of the peak; the table also shows the peak without it.

Time: the median of ``--repeats`` runs after the measured one, same process: wall clock
(``torch.cuda.synchronize`` on GPU) and this process's CPU time. On a shared, loaded CPU box the
CPU-time ratio is the steadier comparison (run with one thread: CPU time = compute time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

MiB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(args) -> dict:
    import torch

    from rlaudit.algo.logprob import logprobs_from_logits

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, generator=g, device=dev, dtype=dtype)
    labels = torch.randint(0, args.vocab, (args.rows,), generator=g, device=dev)
    backward = args.mode == "fwd+bwd"
    logits.requires_grad_(backward)
    t = args.temperature

    def naive():
        x = logits if dtype in (torch.float32, torch.float64) else logits.float()
        logp_all = torch.log_softmax(x / t if t != 1.0 else x, dim=-1)
        logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp.to(dtype), ent.to(dtype)

    def chunked():
        return logprobs_from_logits(logits, labels, temperature=t, calc_entropy=True,
                                    chunk_size=args.chunk_size)

    fn = naive if args.method == "naive" else chunked

    def once():
        logp, ent = fn()
        if backward:
            (logp.float().sum() + ent.float().sum()).backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return logp, ent

    flagged = False
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = once()
        peak_extra = torch.cuda.max_memory_allocated() - base
    else:
        base = _status_kib("VmRSS") * 1024
        if _reset_peak_rss():
            out = once()
            peak_extra = _status_kib("VmHWM") * 1024 - base
        else:
            flagged = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > base
            out = once()
            peak_extra = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    del out
    grad_bytes = logits.numel() * logits.element_size() if backward else 0

    times, cpu_times = [], []
    for _ in range(args.repeats):
        logits.grad = None
        t0, c0 = time.perf_counter(), time.process_time()
        out = once()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        del out
    return {"method": args.method if args.method == "naive" else f"chunked/{args.chunk_size}",
            "mode": args.mode, "peak_extra": peak_extra, "grad_bytes": grad_bytes,
            "logits_bytes": logits.numel() * logits.element_size(),
            "time_s": statistics.median(times), "cpu_s": statistics.median(cpu_times),
            "flagged": flagged}


def _run_case(args, method: str, mode: str, chunk_size: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--method", method, "--mode", mode,
           "--chunk-size", str(chunk_size), "--rows", str(args.rows), "--vocab", str(args.vocab),
           "--dtype", args.dtype, "--repeats", str(args.repeats), "--device", args.device,
           "--threads", str(args.threads), "--temperature", str(args.temperature)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise SystemExit(f"case {method}/{mode} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--chunk-sizes", default="1024,256",
                   help="comma-separated rows per chunk for the chunked method")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--modes", default="fwd,fwd+bwd")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default="naive", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)
    p.add_argument("--chunk-size", type=int, default=1024, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0

    sizes = [int(s) for s in args.chunk_sizes.split(",") if s]
    print(f"rows={args.rows} vocab={args.vocab} dtype={args.dtype} device={args.device} "
          f"threads={args.threads} T={args.temperature} repeats={args.repeats}")
    header = (f"{'method':<16}{'mode':<9}{'peak extra MiB':>15}{'/logits':>9}"
              f"{'excl. grad':>12}{'/logits':>9}{'wall s':>9}{'/naive':>8}"
              f"{'cpu s':>8}{'/naive':>8}")
    print(header)
    print("-" * len(header))
    for mode in args.modes.split(","):
        rows = [_run_case(args, "naive", mode, 0)]
        rows += [_run_case(args, "chunked", mode, cs) for cs in sizes]
        naive_t, naive_c = rows[0]["time_s"], rows[0]["cpu_s"]
        for r in rows:
            lb, ex = r["logits_bytes"], r["peak_extra"]
            print(f"{r['method']:<16}{mode:<9}{ex / MiB:>15.0f}{ex / lb:>9.2f}"
                  f"{(ex - r['grad_bytes']) / MiB:>12.0f}{(ex - r['grad_bytes']) / lb:>9.2f}"
                  f"{r['time_s']:>9.2f}{r['time_s'] / naive_t:>8.2f}"
                  f"{r['cpu_s']:>8.2f}{r['cpu_s'] / naive_c:>8.2f}"
                  + ("  (peak below setup's: upper bound)" if r["flagged"] else ""))
    print(f"logits: {rows[0]['logits_bytes'] / MiB:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
