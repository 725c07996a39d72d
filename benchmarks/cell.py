"""What a notebook user waits for: one cell in a real ipykernel (driven through jupyter_client), from the
execute request to the kernel's idle, and the size of what the cell leaves in the notebook.

Per workload, four cells doing the same work:

* ``plain``     -- the code alone
* ``summary``   -- ``%%tensorscope`` (the summary displayed)
* ``quiet``     -- ``%%tensorscope -q`` (recorded, nothing displayed)
* ``profiler``  -- ``torch.profiler.profile()`` around it and ``print(prof.key_averages().table())``, what a
  torch.profiler user reads

Workloads: a ResNet-18 training step (the ResNet-18 of benchmarks/overhead.py: torchvision's blocks and
widths; batch 2, 3x64x64, SGD with momentum), a 2-layer GPT-2-like step (token and position embeddings,
2 pre-LayerNorm blocks of causal self-attention and a GELU MLP, vocab 1000, d=128, 4 heads, batch 4 x 64
tokens, AdamW) and a 10-step MLP loop (128-256-10, batch 32, SGD). Each cell runs once to warm up, then
the four cells run round robin ``--reps`` times; the table gives the median ms, the multiple of the plain
cell and the cell's output KB (its display data, execute results and streams as the notebook stores
them). The engine each traced cell recorded with is printed (a cold cache records with the python
engine while the native parts compile in the background).

    python benchmarks/cell.py [--reps 7] [--threads 1] [--only resnet18,gpt2,mlp] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SETUP = r"""
import sys, torch, tensorscope
sys.path.insert(0, {here!r})
torch.set_num_threads({threads})
torch.manual_seed(0)
%load_ext tensorscope
"""

WORKLOADS = {
    "resnet18": ("ResNet-18 training step", r"""
from overhead import ResNet18
model = ResNet18()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(2, 3, 64, 64)
y = torch.randint(0, 10, (2,))

def step():
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""),
    "gpt2": ("2-layer GPT-2-like step", r"""
class GPTBlock(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    def __init__(self, vocab=1000, d=128, heads=4, layers=2, ctx=64):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.Sequential(*[GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


model = GPT()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 1000, (4, 64))
targets = torch.randint(0, 1000, (4, 64))

def step():
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    opt.step()
"""),
    "mlp": ("10-step MLP loop", r"""
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 128)
y = torch.randint(0, 10, (32,))

def step():
    for _ in range(10):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
"""),
}

VARIANTS = {
    "plain": "step()",
    "summary": "%%tensorscope\nstep()",
    "quiet": "%%tensorscope -q\nstep()",
    "profiler": ("with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
                 "    step()\n"
                 "print(prof.key_averages().table(sort_by='self_cpu_time_total'))"),
}


class Kernel:
    """A real ipykernel (this interpreter) and a client; ``run`` times one cell."""

    def __init__(self):
        from jupyter_client.manager import KernelManager

        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.km = KernelManager(kernel_cmd=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"])
        self.km.start_kernel(env=env, cwd=HERE)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code, timeout=600.0):
        """(ms from execute_request to idle, output bytes, error or None)."""
        while True:   # nothing left over from an earlier cell
            try:
                self.kc.get_iopub_msg(timeout=0.01)
            except queue.Empty:
                break
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code, store_history=True)
        out_bytes, error = 0, None
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(deadline - time.monotonic(), 0.1))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                ms = (time.perf_counter() - t0) * 1e3
                break
            if kind == "stream":
                out_bytes += len(json.dumps({"name": content["name"], "text": content["text"]}).encode())
            elif kind in ("display_data", "execute_result"):
                out_bytes += len(json.dumps({"data": content["data"], "metadata": content.get("metadata", {})}).encode())
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
        while self.kc.get_shell_msg(timeout=timeout)["parent_header"].get("msg_id") != msg_id:
            pass   # the execute_reply of this cell
        return ms, out_bytes, error

    def value(self, expr):
        """``expr`` evaluated in the kernel (a literal)."""
        import ast

        msg_id = self.kc.execute("pass", user_expressions={"v": expr}, store_history=False)
        while True:
            reply = self.kc.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        got = reply["content"]["user_expressions"]["v"]
        if got.get("status") != "ok":
            raise RuntimeError(f"{expr}: {got}")
        return ast.literal_eval(got["data"]["text/plain"])

    def close(self):
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=True)


def bench(name, reps, threads):
    title, code = WORKLOADS[name]
    k = Kernel()
    try:
        for cell in (SETUP.format(here=HERE, threads=threads), code):
            _, _, err = k.run(cell)
            if err:
                raise RuntimeError(f"{name}: setup failed: {err}")
        runs = {v: [] for v in VARIANTS}
        size = {}
        for v, cell in VARIANTS.items():   # warm-up: each cell once
            _, size[v], err = k.run(cell)
            if err:
                raise RuntimeError(f"{name} {v}: {err}")
        engine = k.value("(tensorscope.last().metadata['engine'], tensorscope.last().ops.num_rows)")
        for _ in range(reps):
            for v, cell in VARIANTS.items():
                ms, nbytes, err = k.run(cell)
                if err:
                    raise RuntimeError(f"{name} {v}: {err}")
                runs[v].append(ms)
                size[v] = nbytes
        engine_after = k.value("tensorscope.last().metadata['engine']")
    finally:
        k.close()
    med = {v: statistics.median(r) for v, r in runs.items()}
    return {"workload": name, "title": title, "ops": engine[1], "engine": engine_after, "engine_warmup": engine[0],
            "reps": reps, "median_ms": med, "runs_ms": runs, "output_bytes": size,
            "x_plain": {v: med[v] / med["plain"] for v in med}}


def table(results):
    lines = [f"{'workload':<28} {'ops':>5} {'cell':<9} {'median ms':>10} {'x plain':>8} {'output KB':>10}"]
    for r in results:
        for i, v in enumerate(VARIANTS):
            head = f"{r['title']:<28} {r['ops']:>5}" if i == 0 else f"{'':<28} {'':>5}"
            lines.append(f"{head} {v:<9} {r['median_ms'][v]:>10.1f} {r['x_plain'][v]:>7.2f}x "
                         f"{r['output_bytes'][v] / 1024:>10.1f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7, help="timed runs of each cell after the warm-up (median)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in the kernel")
    p.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    import torch

    import tensorscope

    print(f"torch {torch.__version__}, tensorscope {tensorscope.__version__}, {os.cpu_count()} cores, "
          f"torch threads {args.threads}, median of {args.reps} after one warm-up, cells round robin")
    results = []
    for name in args.only.split(","):
        r = bench(name.strip(), args.reps, args.threads)
        results.append(r)
        print(f"  {r['title']}: traced with the {r['engine']} engine ({r['ops']} ops; warm-up cell: "
              f"{r['engine_warmup']})", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
