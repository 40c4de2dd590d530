"""The kernels compiled ahead of time into one extension module, so a process that steps
an engine imports neither numba nor LLVM.

Numba's just-in-time dispatchers cost every process that runs a kernel numba's import
and the load of its cached machine code (~0.4 s of CPU and ~105 MB of memory, more than
the simulation itself at 10,000 requests). The same kernels, compiled by numba's
ahead-of-time compiler (``numba.pycc``) for the argument types the engine passes
(:data:`EXPORTS`), are a plain extension module: imported in milliseconds, a few MB.
It is built once per machine, in a detached background process that the first run
starts (~20-30 s: numba compiles every kernel, a C compiler links them; that run and the
runs started meanwhile take the numpy path or numba's dispatchers, the same bits), and
kept beside numba's own cache (``NUMBA_CACHE_DIR``, else the ``__pycache__`` folder of
this package), named by a hash of the kernels' sources, this table and the numba, numpy
and Python versions it was built with, and of the CPU it is compiled for (this
machine's, as numba's dispatchers are): a change to any of them builds a new one.

Numba's dispatchers check each call's argument types and compile a version for new ones;
an exported function takes the one it was built for. So every exported function is
wrapped in C (:func:`_c_source`): a call whose arguments are not exactly the exported
types (an array's element type and size, dimensions, C order, alignment, byte order and,
for an array the kernel writes, writability; an integer, float or boolean scalar) goes to
:func:`fallback`, which runs numba's dispatcher for it, the same bits. Where the module
cannot be built (no C compiler, numba without ``pycc``) the dispatchers run as before;
``DSPARK_SIM_KERNELS=jit`` asks for them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

# Every kernel the engine or a policy calls from Python, by module and name, with the
# types of its arguments: ``f8`` / ``i8`` / ``b1`` scalars; arrays as ``KIND[C]`` (one
# dimension, C order), ``KIND[:,C]`` (two), ``KIND[A]`` (one, any strides), ``ro:`` before
# an array the kernel only reads (a read-only one is then taken too). Kernels called only
# by kernels are compiled into their callers and need no entry.
EXPORTS: dict[str, str] = {
    "dspark_sim.policies.compiled.stretch_sorted": "ro:f8[A] i8",
    "dspark_sim.policies.compiled.budget_displacement":
        "ro:f8[C] i8 ro:f8[C] ro:f8[C] i8 f8 b1",
    "dspark_sim.policies.compiled.counts_at": "ro:f8[:,C] f8 i8",
    "dspark_sim.policies.compiled.lagged_runs":
        "ro:f8[:,C] f8[C] ro:f8[C] ro:i8[:,C] ro:i8[C] i8 i8 i8[C]",
    "dspark_sim.policies.compiled.stacked_lagged":
        "ro:f8[C] ro:i8[:,C] ro:i8[C] i8 i8 i8 f8[C]",
    "dspark_sim.policies.compiled.merged_runs": "f8[C] ro:i8[C]",
    "dspark_sim.policies.compiled.lagged_topk_lengths":
        "ro:f8[:,C] ro:f8[C] f8[C] i8 ro:i8[C] ro:i1[C] f8[C] i8[:,C] i8[C] ro:f8[C] "
        "f8 f8 f8 i8 f8 i8 i8[C] i8[C] b1 b1",
    "dspark_sim.policies.compiled.constant_lengths":
        "ro:i8[C] i8 ro:i1[C] ro:i1[C] i8 i8[C] i8[C]",
    "dspark_sim.policies.compiled.vllm_adaptive_proposed":
        "ro:f8[:,C] ro:f8[C] ro:i8[C] ro:i8[C] ro:i1[C] f8[C] i8[C] ro:f8[C] "
        "f8 f8 f8 i8 f8 i8 i8[C] i8[C]",
    "dspark_sim.sim.fast.replay_chain":
        "i8[:,C] i8 ro:i8[C] ro:i8[C] ro:i8[C] i8[C] i8 f8 ro:f8[C] f8 "
        "i8[C] i8[C] i8[C] f8[C] i8[C] f8[C] ro:f8[:,C] b1 f8[:,C] i8 i8 i8 i8 i8 i8 "
        "i8 i8",
    "dspark_sim.sim.fast.drop_finished": "i8[:,C] f8 i8[C] i8[C] i8[C] f8[C] i8[C]",
    "dspark_sim.sim.fast.remove_rows": "ro:i8[:,C] ro:b1[C] i8[C] i8[C] i8[C]",
    "dspark_sim.sim.fast.admit_fcfs":
        "i8[:,C] i8 ro:i8[:,C] ro:i8[C] i8 b1 ro:i8[C] i8 i8 i8[:,C]",
    "dspark_sim.sim.fast.decode_attention_units": "ro:i8[:,C] i8 ro:i8[C] i8",
    "dspark_sim.sim.fast.extra_terms": "i8 i8 i8 f8 ro:f8[C]",
    "dspark_sim.sim.fast.decision_runs":
        "ro:i8[:,C] i8 ro:f8[:,C] i8[:,C] f8[:,C] f8[C] i8 f8 ro:f8[C] ro:f8[C] "
        "ro:i8[:,C] ro:i8[C] i8 i8 i8[C]",
    "dspark_sim.sim.fast.priced_topk_lengths":
        "i8 ro:f8[:,C] ro:f8[C] f8[C] i8 i8[:,C] ro:i1[C] f8[C] i8[:,C] i8[C] ro:f8[C] "
        "f8 f8 f8 i8 f8 i8 b1 b1 ro:i8[:,C] ro:f8[C] i8 f8 ro:f8[C] b1",
    "dspark_sim.sim.fast.decode_step_s":
        "ro:i8[:,C] i8 ro:i8[C] i8 ro:f8[C] i8 f8 ro:f8[C] b1",
    "dspark_sim.sim.fast.prefill_chunks": "ro:i8[:,C] i8 i8 i8[:,C]",
    "dspark_sim.sim.fast.chunked_step_s":
        "ro:i8[:,C] i8 ro:i8[C] i8 ro:i8[C] ro:i8[C] ro:f8[C] i8 f8 ro:f8[C] b1",
    "dspark_sim.sim.fast.trace_positions": "ro:i8[:,C] i8 i8[C]",
    "dspark_sim.sim.fast.gather_proposed":
        "ro:i8[:,C] i8 ro:f8[:,C] ro:i1[C] i8[C] f8[:,C] i8[C] f8[C]",
    "dspark_sim.sim.fast.gather_trace_rows":
        "ro:i8[:,C] i8 ro:f8[:,C] i8[C] f8[:,C] f8[C]",
    "dspark_sim.sim.ahead.front_end_run":
        "f8[:,C] ro:i8[:,C] i8[C] f8[C] i8[:,C] i8[C] f8[C] i8[C] i8[:,C] i8[:,C] i8[C] "
        "f8[C] f8[C] f8[C] f8 i8 ro:f8[C] f8 f8 f8",
}

# element kinds: (numpy's kind character, item size, numba's type name)
_KINDS = {"f8": ("f", 8, "float64"), "i8": ("i", 8, "int64"), "i1": ("i", 1, "int8"),
          "b1": ("b", 1, "boolean")}
PREFIX = "_dspark_kernels_"
_SELF = "dspark_sim.policies.aot"  # ``-m`` for the build (run as ``__main__``, too)
FORMAT = 1  # the layout of the module and of this file's C; a change rebuilds


def _parse(spec: str) -> list[tuple]:
    """``EXPORTS``' words as (kind, ndim, C order, writable) for arrays, (kind,) for
    scalars."""
    out = []
    for word in spec.split():
        readonly = word.startswith("ro:")
        word = word.removeprefix("ro:")
        if "[" not in word:
            out.append((word,))
            continue
        kind, dims = word[:-1].split("[")
        out.append((kind, dims.count(",") + 1, dims.endswith("C"), not readonly))
    return out


def _export_name(qualified: str) -> str:
    """The function's name in the module (and in C): ``fast__replay_chain``."""
    module, name = qualified.rsplit(".", 1)
    return f"{module.rsplit('.', 1)[1]}__{name}"


def _file_text(spec: importlib.machinery.ModuleSpec | None) -> bytes:
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return b""
    return Path(spec.origin).read_bytes()


def _version_text(package: str) -> bytes:
    """A package's version file, read without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return b""
    path = Path(next(iter(spec.submodule_search_locations))) / "_version.py"
    return path.read_bytes() if path.is_file() else package.encode()


def _cpu_text() -> str:
    """The CPU the module is compiled for, as the key names it: on Linux its vendor,
    model and feature flags (``/proc/cpuinfo``'s first processor); elsewhere empty, and
    the module is compiled for the architecture's generic CPU."""
    names = ("vendor_id", "cpu family", "model", "flags", "Features", "CPU implementer",
             "CPU architecture", "CPU variant", "CPU part")
    keep = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:  # the first processor's lines: a many-core file is long
                if not line.strip():
                    break
                if line.split(":", 1)[0].strip() in names:
                    keep.append(line.rstrip())
    except OSError:
        return ""
    return "\n".join(keep)


@functools.cache
def key() -> str:
    """What the module is built from: this file, the kernels' modules' sources, and the
    numba, llvmlite, numpy and Python it is built with and for; then, after ``_``, the
    CPU it is compiled for (:func:`_cpu_text`)."""
    import numpy as np

    h = hashlib.sha256()
    h.update(f"{FORMAT} {sys.version} {np.__version__} {sysconfig.get_platform()}".encode())
    h.update(Path(__file__).read_bytes())
    for module in sorted({q.rsplit(".", 1)[0] for q in EXPORTS}):
        h.update(module.encode())
        h.update(_file_text(importlib.util.find_spec(module)))
    for package in ("numba", "llvmlite"):
        h.update(_version_text(package))
    cpu = hashlib.sha256(_cpu_text().encode()).hexdigest()[:8]
    return f"{h.hexdigest()[:20]}_{cpu}"


def cache_dir() -> Path:
    """Where numba keeps its cache: ``NUMBA_CACHE_DIR``, else beside this package, else
    (an installation this user cannot write) in the user's cache folder."""
    root = os.environ.get("NUMBA_CACHE_DIR", "").strip()
    if root:
        return Path(root) / "dspark_sim_aot"
    here = Path(__file__).resolve().parent
    if os.access(here / "__pycache__", os.W_OK) or os.access(here, os.W_OK):
        return here / "__pycache__"
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache"
    return Path(base) / "dspark-sim" / "kernels"


def module_path(k: str | None = None) -> Path:
    name = PREFIX + (k or key())
    return cache_dir() / (name + importlib.machinery.EXTENSION_SUFFIXES[0])


_loaded: dict[str, object] | None = None


def load(wait: bool = False) -> dict[str, object] | None:
    """Qualified kernel name -> the compiled function, from the module built for this
    machine; None where there is none yet (the caller runs numba's dispatchers or the
    numpy path). A missing module is built in a detached process (:func:`start_build`)
    that later processes pick up, so no run waits for the build's ~30 s; ``wait`` builds it
    here, or waits for the build under way (the tests of the module itself). Loaded once
    per process; a miss is looked for again on the next call."""
    global _loaded
    if _loaded:
        return _loaded
    k = key()
    path = module_path(k)
    if not path.is_file():
        if wait:
            _build_once(path, k)
        else:
            start_build(path, k)
    module = _import(path, PREFIX + k) if path.is_file() else None
    if module is None:
        return None
    _loaded = {q: getattr(module, _export_name(q)) for q in EXPORTS}
    return _loaded


def available() -> bool:
    """The module is built for this machine (nothing imported, nothing built)."""
    return bool(_loaded) or module_path().is_file()


def failed() -> bool:
    """A build of the module for these sources failed on this machine (it is not tried
    again: the numba dispatchers' cache is what runs here)."""
    return module_path().with_suffix(".failed").is_file()


def _import(path: Path, name: str):
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its C looks its fallback up here
        loader.exec_module(module)
    except ImportError:
        sys.modules.pop(name, None)
        return None
    module._fallback = fallback
    return module


def _open_lock(path: Path):
    """The build's lock file (one per key), or None where the folder cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path.with_suffix(".lock"), "a")
    except OSError:
        return None


def start_build(path: Path | None = None, k: str | None = None) -> bool:
    """Build the module in a detached, niced process unless it is built, a build for
    this key failed before, or another process is building it (it holds the key's lock:
    one build at a time, whatever runs concurrently, pytest-xdist's workers included).
    The child inherits the lock, so it stays taken until the build ends or the child
    dies. Returns whether a build was started."""
    import fcntl

    k = k or key()
    path = path or module_path(k)
    lock = _open_lock(path)
    if lock is None:
        return False
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a build under way
            return False
        if path.is_file() or path.with_suffix(".failed").is_file():
            return False
        try:
            subprocess.Popen([sys.executable, "-m", _SELF, "--install", str(path), k,
                              str(lock.fileno())], pass_fds=(lock.fileno(),),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True,
                             env={**os.environ, "DSPARK_SIM_KERNELS": "jit"})
        except OSError:
            return False
    return True  # this process's copy of the lock closed; the child's holds it


def _build_once(path: Path, k: str) -> None:
    """Build the module into ``path`` here, or wait for the build under way (the lock's
    holder) and take what it left."""
    lock = _open_lock(path)
    if lock is None:
        return
    with lock:
        import fcntl

        fcntl.flock(lock, fcntl.LOCK_EX)
        _build_locked(path, k)


def _build_locked(path: Path, k: str) -> None:
    """The build, by the holder of the key's lock: compiled in a child process into a
    temporary folder beside ``path``, then renamed into place in one step, so a build
    that fails or is killed never leaves a module to import; a failure's error is kept
    beside it (``.failed``) and the build is not tried again for this key."""
    failed_file = path.with_suffix(".failed")
    if path.is_file() or failed_file.is_file():
        return
    for stale in path.parent.glob(f"build-{k}-*"):  # a killed build's (the lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f"build-{k}-", dir=path.parent) as tmp:
        env = {**os.environ, "DSPARK_SIM_KERNELS": "jit"}
        res = subprocess.run([sys.executable, "-m", _SELF, tmp, PREFIX + k],
                             capture_output=True, text=True, env=env)
        built = Path(tmp) / path.name
        if res.returncode == 0 and built.is_file():
            os.replace(built, path)
            _prune(path.parent, PREFIX + k)
        else:
            with contextlib.suppress(OSError):
                failed_file.write_text(_tail(res.stderr) or f"exit {res.returncode}")


def _prune(folder: Path, keep: str) -> None:
    """The modules (and failures) of other keys for this CPU or for none named: sources
    since changed. A machine with another CPU that shares the folder keeps its own."""
    cpu = keep.rsplit("_", 1)[1]
    for old in folder.glob(PREFIX + "*"):
        built_for = old.name.split(".", 1)[0][len(PREFIX):].partition("_")[2]
        if not old.name.startswith(keep + ".") and built_for in ("", cpu) and old.is_file():
            with contextlib.suppress(OSError):
                old.unlink()


def _tail(text: str, lines: int = 60) -> str:
    """A failed build's error, as kept beside it: the compiler's message comes before
    the traceback that reports it."""
    keep = [line for line in text.splitlines() if "error" in line.lower()][:20]
    return "\n".join([*keep, "...", *text.splitlines()[-lines:]])


def fallback(qualified: str, args: tuple, kws: dict | None):
    """A call whose arguments the exported function was not built for: numba's
    dispatcher of the same kernel runs it (compiled for them, as it would have been)."""
    from dspark_sim.policies import compiled

    return compiled.jit_dispatcher(qualified)(*args, **(kws or {}))


# -- the build (run in a child process: ``python -m dspark_sim.policies.aot DIR NAME``) --
def _c_check(i: int, arg: tuple) -> str:
    item = f"PyTuple_GET_ITEM(args, {i})"
    if len(arg) == 1:
        return {"f8": f"PyFloat_Check({item})", "i8": f"is_int({item})",
                "b1": f"is_bool({item})"}[arg[0]]
    kind, ndim, c_order, writable = arg
    char, size, _ = _KINDS[kind]
    return (f"is_array({item}, '{char}', {size}, {ndim}, {int(c_order)}, "
            f"{int(writable)})")


def _c_source(name: str) -> str:
    """The checks in front of each exported function (see the module docstring)."""
    parts = [_C_HEAD.replace("@MODULE@", name)]
    for q, spec in EXPORTS.items():
        e = _export_name(q)
        args = _parse(spec)
        checks = " &&\n        ".join(_c_check(i, a) for i, a in enumerate(args))
        parts.append(f"""
PyObject *dspark_raw_{e}(PyObject *, PyObject *, PyObject *);
DSPARK_HIDDEN PyObject *
dspark_checked_{e}(PyObject *self, PyObject *args, PyObject *kws)
{{
    if (ready() && (kws == NULL || PyDict_GET_SIZE(kws) == 0)
        && PyTuple_GET_SIZE(args) == {len(args)} &&
        {checks})
        return dspark_raw_{e}(self, args, kws);
    if (PyErr_Occurred())
        return NULL;
    return fall_back("{q}", args, kws);
}}
""")
    return "".join(parts)


_C_HEAD = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

#define DSPARK_HIDDEN __attribute__((visibility("hidden")))

static PyTypeObject *nd_type, *int64_type, *bool_type;

static PyTypeObject *
numpy_type(PyObject *np, const char *name)
{
    PyObject *t = PyObject_GetAttrString(np, name);
    if (t != NULL && !PyType_Check(t)) {
        Py_DECREF(t);
        PyErr_Format(PyExc_TypeError, "numpy.%s is not a type", name);
        return NULL;
    }
    return (PyTypeObject *)t;
}

static int
ready(void)
{
    if (nd_type != NULL)
        return 1;
    PyObject *np = PyImport_ImportModule("numpy");
    if (np == NULL)
        return 0;
    nd_type = numpy_type(np, "ndarray");
    int64_type = nd_type ? numpy_type(np, "int64") : NULL;
    bool_type = int64_type ? numpy_type(np, "bool_") : NULL;
    Py_DECREF(np);
    if (bool_type == NULL) {
        Py_CLEAR(nd_type);
        Py_CLEAR(int64_type);
        return 0;
    }
    return 1;
}

static int
is_int(PyObject *o)
{
    return (PyLong_Check(o) && !PyBool_Check(o)) || Py_TYPE(o) == int64_type;
}

static int
is_bool(PyObject *o)
{
    return PyBool_Check(o) || Py_TYPE(o) == bool_type;
}

/* the element type by its number (the descriptor's size field moved in numpy 2) */
static int
is_type(const PyArray_Descr *d, char kind, int size)
{
    switch (d->type_num) {
    case NPY_BOOL: return kind == 'b' && size == 1;
    case NPY_BYTE: return kind == 'i' && size == 1;
    case NPY_DOUBLE: return kind == 'f' && size == 8;
    case NPY_LONG: return kind == 'i' && size == (int)sizeof(long);
    case NPY_LONGLONG: return kind == 'i' && size == (int)sizeof(long long);
    default: return 0;
    }
}

static int
is_array(PyObject *o, char kind, int size, int ndim, int c_order, int writable)
{
    if (!PyObject_TypeCheck(o, nd_type))
        return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    PyArray_Descr *d = PyArray_DESCR(a);
    int flags = PyArray_FLAGS(a);
    return PyArray_NDIM(a) == ndim && is_type(d, kind, size)
        && d->byteorder != '>' && (flags & NPY_ARRAY_ALIGNED)
        && (!c_order || (flags & NPY_ARRAY_C_CONTIGUOUS))
        && (!writable || (flags & NPY_ARRAY_WRITEABLE));
}

static PyObject *
fall_back(const char *qualified, PyObject *args, PyObject *kws)
{
    PyObject *module = PyDict_GetItemString(PyImport_GetModuleDict(), "@MODULE@");
    if (module == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "@MODULE@ is not in sys.modules");
        return NULL;
    }
    PyObject *fb = PyObject_GetAttrString(module, "_fallback");
    if (fb == NULL)
        return NULL;
    PyObject *name = PyUnicode_FromString(qualified);
    PyObject *out = name ? PyObject_CallFunctionObjArgs(fb, name, args,
                                                        kws ? kws : Py_None, NULL) : NULL;
    Py_XDECREF(name);
    Py_DECREF(fb);
    return out;
}
"""


def _numba_type(arg: tuple):
    from numba import types

    if len(arg) == 1:
        return {"f8": types.float64, "i8": types.int64, "b1": types.boolean}[arg[0]]
    kind, ndim, c_order, writable = arg
    dtype = getattr(types, _KINDS[kind][2])
    return types.Array(dtype, ndim, "C" if c_order else "A", readonly=not writable)


def build(out_dir: Path, name: str) -> Path:
    """Compile every exported kernel into the extension module ``name`` in ``out_dir``
    (numba's dispatchers bound first: kernels call kernels)."""
    import importlib

    import numpy as np
    from numba.core import typing
    from numba.pycc import CC
    from numba.pycc.compiler import ExportEntry, ModuleCompiler

    from dspark_sim.policies import compiled

    for module in {q.rsplit(".", 1)[0] for q in EXPORTS}:
        importlib.import_module(module)
    compiled.bind_jit()
    out_dir = Path(out_dir)
    c_file = out_dir / f"{name}_checks.c"
    c_file.write_text(_c_source(name))

    class Compiler(ModuleCompiler):
        """pycc's module, its method table pointing at the checks (which call pycc's
        wrappers, renamed to C names)."""

        def _mangle_method_symbol(self, func_name):
            return f"dspark_raw_{func_name}"

        def _emit_method_array(self, llvm_module):
            original = self._mangle_method_symbol
            self._mangle_method_symbol = lambda n: f"dspark_checked_{n}"
            try:
                return super()._emit_method_array(llvm_module)
            finally:
                self._mangle_method_symbol = original

    class Module(CC):
        def _get_mixin_sources(self):
            return [*super()._get_mixin_sources(), str(c_file)]

        def _compile_mixins(self, build_dir):
            include = self._toolchain.get_python_include_dirs() + [np.get_include()]
            return self._toolchain.compile_objects(
                self._get_mixin_sources(), build_dir, include_dirs=include,
                macros=self._get_mixin_defines(), extra_cflags=self._get_extra_cflags())

        def _compile_object_files(self, build_dir):
            compiler = Compiler(self._export_entries, self._basename, self._use_nrt,
                                cpu_name=self._target_cpu)
            compiler.external_init_function = self._init_function
            obj = os.path.join(build_dir, name + ".o")
            compiler.write_native_object(obj, wrap=True)
            return [obj], compiler.dll_exports

    cc = Module(name, source_module=compiled.__name__)
    cc.output_dir = str(out_dir)
    # this machine's CPU (the build runs where the module is loaded, and the key names the
    # CPU), as numba's dispatchers compile: the gather, the sort runs' partition and the
    # budget search vectorize with its wider registers, without fast math (no reordered
    # sums, no fused multiply-adds: the same bits)
    cc.target_cpu = "host" if _cpu_text() else ""
    for q, spec in EXPORTS.items():
        module, fn = q.rsplit(".", 1)
        kernel = vars(sys.modules[module])[fn]
        sig = typing.signature(None, *(_numba_type(a) for a in _parse(spec)))
        cc._exported_functions[_export_name(q)] = ExportEntry(_export_name(q), sig,
                                                              kernel.py_func)
    cc.compile()
    return out_dir / cc.output_file


def _install(path: Path, k: str, lock_fd: int) -> None:
    """The detached build (:func:`start_build`): niced, holding the inherited lock until
    it exits."""
    with contextlib.suppress(OSError):
        os.nice(10)
    with open(lock_fd, "a"):
        _build_locked(path, k)


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")  # pycc's pending deprecation
    if sys.argv[1] == "--install":
        _install(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    else:
        build(Path(sys.argv[1]), sys.argv[2])
