"""Per-shell state of the IPython integration: pending cells, the running trace, always-on mode.

The code injected into a traced cell calls ``tensorscope.magics._cell.begin(token)``
and ``end(token, value)``, which land here. Tokens tie the injected calls to the
options parsed for that very cell, so a cell that was transformed but never run
cannot hand its options to another.
"""
from __future__ import annotations

import ast
import itertools
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..options import DisplayOptions, RunContext, TraceOptions

_CELL_RE = re.compile(r"^\s*%%tensorscope(?:\s+(?P<args>.*))?$")
_controllers: dict[int, Controller] = {}


@dataclass
class CellRequest:
    """One traced cell: its options, parsed once from the magic's line, and what to do after it."""

    token: int
    options: TraceOptions = field(default_factory=TraceOptions)
    display: DisplayOptions = field(default_factory=DisplayOptions)
    output: Optional[str] = None
    save: Optional[str] = None
    quiet: bool = False
    cell_source: str = ""
    keep_history: bool = True
    deferred_kernels: bool = False
    origin: str = "magic"   # or "always_on" (RunContext.origin)
    trace_cm: Any = None
    result: Any = None
    error: Optional[BaseException] = field(default=None, repr=False)
    ended: bool = False


def get_controller(shell, create: bool = True) -> Optional[Controller]:
    ctl = _controllers.get(id(shell))
    if ctl is None and create:
        ctl = _controllers[id(shell)] = Controller(shell)
    return ctl


class Controller:
    """The magics' state in one IPython shell: the cell requests parsed and not yet run, the one
    tracing now, the last finished, and ``%tensorscope on``'s always-on request; installs and removes the
    shell's pre/post-run-cell hooks that start and stop each trace."""

    def __init__(self, shell):
        self.shell = shell
        self.installed = False
        self._tokens = itertools.count(1)
        self.pending: dict[int, CellRequest] = {}
        self.active: Optional[CellRequest] = None
        self.finished: Optional[CellRequest] = None
        self.always_on: Optional[CellRequest] = None   # the parsed line of %tensorscope on, or None
        self._armed = False   # set by pre_run_cell: the next AST transform is the cell's own (not %timeit's)
        self._cell_token = None   # (raw cell key, token) of the %%tensorscope cell being transformed
        self._exc_hook = None    # (custom_exceptions, CustomTB) saved while a traced cell runs
        self._ast = _Injector(self)
        self._parse: Optional[Callable[[str], CellRequest]] = None

    # -- install -------------------------------------------------------------
    def install(self, parse: Callable[[str], CellRequest]):
        """Hook into the shell; ``parse`` turns a ``%%tensorscope`` line's options into a request
        (magics.parse_cell_args: the magic declares the options, so it is handed down, not imported)."""
        self._parse = parse
        sh = self.shell
        sh.input_transformers_cleanup.insert(0, self.transform_lines)
        sh.ast_transformers.append(self._ast)
        sh.events.register("post_run_cell", self.post_run_cell)
        sh.events.register("pre_run_cell", self.pre_run_cell)
        self.installed = True

    def uninstall(self):
        sh = self.shell
        self._stop_active(None)
        self._unhook_exceptions()
        for lst, item in ((sh.input_transformers_cleanup, self.transform_lines), (sh.ast_transformers, self._ast)):
            while item in lst:
                lst.remove(item)
        for ev, fn in (("post_run_cell", self.post_run_cell), ("pre_run_cell", self.pre_run_cell)):
            try:
                sh.events.unregister(ev, fn)
            except ValueError:
                pass
        self.installed = False
        _controllers.pop(id(sh), None)

    # -- step 1: the raw cell ---------------------------------------------------
    def transform_lines(self, lines):
        if not lines:
            return lines
        m = _CELL_RE.match(lines[0].rstrip("\n"))
        if m is None:
            self._cell_token = None   # a token of an earlier cell that never reached the AST stage
            return lines
        argline = (m.group("args") or "").strip()
        if argline.endswith("?"):
            return lines          # %%tensorscope? is help: IPython handles it
        if self._parse is None:
            return lines
        try:
            req = self._parse(argline)
        except BaseException:
            return lines          # the real cell magic reports the usage error, runs nothing
        req.token = next(self._tokens)
        req.cell_source = "".join(lines[1:])
        self.pending[req.token] = req
        while len(self.pending) > 32:   # transformed but never run (e.g. inspection): forget
            self.pending.pop(next(iter(self.pending)))
        # The magic's line becomes a comment (line numbers stay true, and a traceback that shows the
        # top of the cell shows the user's magic, nothing injected); the call that starts the trace is
        # inserted by the AST transformer at that line, for the cell whose raw text this is.
        self._cell_token = (_cell_key(lines), req.token)
        return ["# " + lines[0].strip() + "\n"] + lines[1:]

    # IPython's check_complete must not create requests (IPython reads this attribute of a transform)
    transform_lines.has_side_effects = True  # type: ignore[attr-defined]

    # -- step 2: runtime calls from the cell ------------------------------------
    def begin(self, token: int):
        req = self.pending.pop(token, None)
        if req is None:
            return
        self._stop_active(None)   # a trace left by an interrupted cell ends here
        from ..recording.session import trace

        opts = req.options
        if isinstance(opts.baseline, str):   # --baseline VAR: resolved now, before the cell runs
            from .diff import resolve_trace

            opts = opts.replace(baseline=resolve_trace(opts.baseline, self.shell.user_ns))

        cell = getattr(self, "_cell_count", None)
        if cell is None:
            cell = getattr(self.shell, "execution_count", None)
        ctx = RunContext(cell=cell, cell_source=req.cell_source, keep_history=req.keep_history,
                         deferred_kernels=req.deferred_kernels, origin=req.origin)
        req.trace_cm = trace(opts, context=ctx, display=req.display)
        self.active = req
        self._hook_exceptions()
        req.trace_cm.__enter__()

    def _hook_exceptions(self):
        """Until the cell ends, clean a traceback of the tracer's frames before IPython shows it.

        IPython's custom-exception slot is the one place that sees the exception with every frame
        (the cell's, torch's, the tracer's) before it is displayed; a handler already there is
        chained, not replaced, and put back when the cell ends.
        """
        sh = self.shell
        if self._exc_hook is not None or not hasattr(sh, "set_custom_exc"):
            return
        prev_types, prev_tb = getattr(sh, "custom_exceptions", ()), getattr(sh, "CustomTB", None)

        def handler(shell, etype, value, tb, tb_offset=None):
            try:
                from ..recording.frames import clean_traceback

                clean_traceback(value)
                tb = value.__traceback__
            except Exception:
                pass
            if prev_types and isinstance(value, prev_types) and prev_tb is not None:
                return prev_tb(etype, value, tb, tb_offset=tb_offset)
            shell.showtraceback(running_compiled_code=True)   # what run_code does without a handler
            return None

        sh.set_custom_exc((BaseException,), handler)
        self._exc_hook = (prev_types, prev_tb, sh.CustomTB)

    def _unhook_exceptions(self):
        saved, self._exc_hook = self._exc_hook, None
        if saved is None:
            return
        sh = self.shell
        if getattr(sh, "CustomTB", None) is saved[2]:   # unless the user installed their own meanwhile
            sh.custom_exceptions, sh.CustomTB = saved[0], saved[1]

    def end(self, token: int, value):
        req = self.active
        if req is None or req.token != token:
            return value
        self._finish(req, None)
        if req.error is not None:
            err, req.error = req.error, None
            raise err
        return value

    def _finish(self, req: CellRequest, exc: Optional[BaseException]):
        from ..errors import TensorscopeError

        self.active = None
        req.ended = True
        try:
            req.trace_cm.__exit__(type(exc) if exc else None, exc, None)
        except TensorscopeError as g:
            if req.trace_cm._trace is None:
                raise
            # raised after the cell ran with the trace kept (a guard that failed, a spill or a
            # dataset write that failed): the trace is delivered, the error raised at line 1
            req.error = g
        req.result = req.trace_cm._trace
        if req.output:
            self.shell.user_ns[req.output] = req.result
        self.finished = req

    def _stop_active(self, exc):
        if self.active is not None:
            try:
                self._finish(self.active, exc)
            except Exception as e:  # never break the shell
                print(f"tensorscope: could not stop the previous trace: {e}", file=sys.stderr)

    # -- events -------------------------------------------------------------------
    def pre_run_cell(self, info=None):
        self._armed = True
        self._raw_cell = getattr(info, "raw_cell", "") or ""
        pending = self._cell_token
        if pending is not None and pending[0] != _cell_key(self._raw_cell.splitlines(keepends=True)):
            self._cell_token = None   # transformed for something else (inspection...), never run
        # IPython has already counted this cell when pre_run_cell fires
        count = getattr(self.shell, "execution_count", None)
        if count is not None and getattr(info, "store_history", False) and not getattr(info, "silent", False):
            count -= 1
        self._cell_count = count
        if self.active is not None:
            self._stop_active(KeyboardInterrupt("cell interrupted before the trace could stop"))
            self.finished = None

    def post_run_cell(self, result=None):
        self._unhook_exceptions()
        if self.active is not None:
            exc = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            self._stop_active(exc)
        req, self.finished = self.finished, None
        if req is None or req.result is None:
            return
        deliver(req.result, save=req.save, quiet=req.quiet, display=req.display)


def deliver(t, save: Optional[str], quiet: bool, display: Optional[DisplayOptions] = None) -> None:
    """The end of a traced cell, whichever way it ran: save the trace (``--save``), then display its
    summary with the cell's display options (unless ``--quiet``). A failure of either is reported on
    stderr and never hides the cell's result."""
    if save:
        try:
            t.save(save)
        except Exception as e:
            print(f"tensorscope: {e}", file=sys.stderr)
    if not quiet:
        try:
            from IPython.display import display as show

            show(t.summary(display))
        except Exception as e:
            print(f"tensorscope: could not display the summary: {e}", file=sys.stderr)


class _Injector(ast.NodeTransformer):
    """Wraps the last expression of a marked (or, when always-on, any) cell in ``end(token, value)``."""

    def __init__(self, ctl: Controller):
        self.ctl = ctl

    def visit_Module(self, node):
        body = node.body
        armed, self.ctl._armed = self.ctl._armed, False
        token = None
        pending, self.ctl._cell_token = self.ctl._cell_token, None
        if pending is not None:
            token = pending[1]
            # at line 1, the magic's own (now a comment): an error while starting points there
            body.insert(0, _at_line(_call_stmt("begin", token), 1))
        if token is None and armed and self.ctl.always_on is not None and body and not _only_tensorscope_magic(body):
            token = next(self.ctl._tokens)
            on = self.ctl.always_on
            req = CellRequest(token=token, options=on.options, display=on.display, quiet=True, deferred_kernels=True,
                              origin="always_on", cell_source=getattr(self.ctl, "_raw_cell", ""))
            self.ctl.pending[token] = req
            body.insert(0, ast.copy_location(_call_stmt("begin", token), body[0]))
        if token is None:
            return node
        last = body[-1]
        # end() raises a GuardError: its call sits at line 1 (the magic), so the error points there
        if isinstance(last, ast.Expr) and len(body) > 1:
            last.value = _at_line(_call("end", token, last.value), 1)
        else:
            body.append(_at_line(_call_stmt("end", token, ast.Constant(None)), 1))
        ast.fix_missing_locations(node)
        return node


def _runtime():
    return ast.Call(func=ast.Name(id="__import__", ctx=ast.Load()),
                    args=[ast.Constant("tensorscope.magics._cell")],
                    keywords=[ast.keyword(arg="fromlist", value=ast.List(elts=[ast.Constant("_")], ctx=ast.Load()))])


def _call(name, token, *args):
    return ast.Call(func=ast.Attribute(value=_runtime(), attr=name, ctx=ast.Load()),
                    args=[ast.Constant(token), *args], keywords=[])


def _call_stmt(name, token, *args):
    return ast.Expr(value=_call(name, token, *args))


def _at_line(node, line: int):
    """Put the injected nodes (those without a location) at ``line``; the user's own keep theirs."""
    for n in ast.walk(node):
        if "lineno" in n._attributes and getattr(n, "lineno", None) is None:
            located: Any = n   # any node class that has a location (``_attributes`` says so)
            located.lineno = located.end_lineno = line
            located.col_offset = located.end_col_offset = 0
    return node


def _cell_key(lines) -> str:
    text = "".join(lines)
    return text if text.endswith("\n") else text + "\n"


def _only_tensorscope_magic(body) -> bool:
    """A cell that only runs %tensorscope line magics (on/off/last...) is not itself traced."""
    for stmt in body:
        try:
            call = stmt.value
            if not (call.func.attr == "run_line_magic" and call.args[0].value == "tensorscope"):
                return False
        except (AttributeError, IndexError):
            return False
    return True
