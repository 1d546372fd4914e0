"""megacritic.compat.apply: the one list of changes to upstream megatron-core, version-guarded.

Each scenario runs in a fresh interpreter (the changes are process-global): it imports the library and every
Megatron module the changes touch, snapshots the attributes of every loaded ``megatron.*`` and ``torch.*``
module and of the classes they define, runs the scenario and reports which attributes now hold another
object. The expected lists below are written out by hand: a change added to or removed from
``megacritic.compat`` fails here until its line is added or removed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

# Every Megatron module whose global ``torch`` the CPU backend replaces (megacritic.compat.cpu).
CPU_TORCH_MODULES = (
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.parallel_state",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.random",
    "megatron.core.timers",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.module",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.utils",
    "megatron.core.utils",
)

# Made on every run (CPU or GPU, without Transformer Engine or apex).
ALWAYS = {
    "megatron.core.transformer.moe.moe_utils:te_general_gemm",  # the router GEMM without TE
    "megatron.core.optimizer.clip_grads:l2_norm_impl",  # foreach grad norm
    "megatron.core.optimizer.clip_grads:multi_tensor_scale_impl",  # foreach grad scale (clip)
    "megatron.core.optimizer.optimizer:multi_tensor_scale_impl",  # foreach grad scale (optimizer)
}
# on_cpu=True: Megatron-Core on CPU.
CPU = {f"{module}:torch" for module in CPU_TORCH_MODULES} | {
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
    "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
    "megatron.core.optimizer.optimizer:clip_grad_by_total_norm_fp32",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
}
# fused=True on CUDA: weight gradients accumulated in the GEMM without apex; the MLPs' SwiGLU in Triton.
FUSED_CUDA = {
    "megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda",
    "megatron.core.tensor_parallel.layers:_grad_accum_fusion_available",
    "megatron.core.transformer.mlp:bias_swiglu_impl",
    "megatron.core.transformer.moe.shared_experts:bias_swiglu_impl",
}

_MARK = "@@CHANGED@@"

_PRELUDE = textwrap.dedent(
    """
    import importlib, inspect, json, pkgutil, sys, types, warnings
    warnings.simplefilter("ignore")
    import torch

    def _watched(name):
        return name.split(".")[0] in ("megatron", "torch")

    def snapshot():
        out = {}
        for name, module in list(sys.modules.items()):
            if module is None or not _watched(name):
                continue
            for attr, value in list(vars(module).items()):
                out[(name, attr)] = value
                if inspect.isclass(value) and value.__module__ == name:
                    for cattr, cvalue in list(vars(value).items()):
                        out[(name, attr + "." + cattr)] = cvalue
        return out

    def changed(before, after):
        # attributes of the modules in `before` (and of their classes) added, replaced or removed
        out, modules = set(), {name for name, _ in before}
        for (name, attr), value in after.items():
            if name not in modules or (name, attr) in before and before[(name, attr)] is value:
                continue
            if attr.endswith("__warningregistry__"):
                continue  # the warnings module's record of the warnings shown
            if isinstance(value, types.ModuleType) and sys.modules.get(name + "." + attr) is value:
                continue  # a submodule was imported, nothing changed
            out.add(name + ":" + attr)
        out |= {name + ":" + attr for name, attr in before if (name, attr) not in after}
        return sorted(out)

    def report(**results):
        print(MARK + json.dumps(results), flush=True)

    # megacritic's engine and config classes for verl subclass verl's own classes: they load only beside verl
    NEEDS_VERL = ("megacritic.integrations.verl.config_classes", "megacritic.integrations.verl.engine")

    def library_modules():
        import importlib.util, megacritic
        names = sorted(m.name for m in pkgutil.walk_packages(megacritic.__path__, "megacritic."))
        return names if importlib.util.find_spec("verl") else [n for n in names if n not in NEEDS_VERL]
    """
)

# The library and every module a change touches are loaded before the first snapshot; apply() must load
# nothing new (a module it loaded would escape the comparison).
_LOADED = textwrap.dedent(
    """
    for name in library_modules() + MODULES:
        importlib.import_module(name)
    from megacritic import compat
    loaded = {m for m in sys.modules if _watched(m)}
    """
)

_APPLY = _LOADED + textwrap.dedent(
    """
    before = snapshot()
    compat.apply(on_cpu=ON_CPU, fused=FUSED)
    after = snapshot()
    compat.apply(on_cpu=ON_CPU, fused=FUSED)
    report(changed=changed(before, after), again=changed(after, snapshot()),
           new_modules=sorted({m for m in sys.modules if _watched(m)} - loaded))
    """
)

_WRONG_VERSION = _LOADED + textwrap.dedent(
    """
    from megatron.core import package_info
    package_info.__version__ = "0.17.0"
    before = snapshot()
    try:
        compat.apply(on_cpu=True, fused=True)
        error = None
    except compat.UnsupportedVersion as e:
        error = str(e)
    after = snapshot()
    report(changed=changed(before, after), error=error)
    """
)

# Importing the library (every module) and building a TransformerConfig change nothing upstream, and the
# library's modules leave the warning filters alone (the command line's modules own the process and may set
# them in their main()).
_IMPORT = textwrap.dedent(
    """
    import subprocess
    # The third-party modules importing the whole library loads (Megatron, torch, transformers, tensordict,
    # which registers things of its own in torch ...), loaded here without the library.
    probe = "import importlib, importlib.util, pkgutil, sys, megacritic\\n" \\
        f"skip = () if importlib.util.find_spec('verl') else {NEEDS_VERL!r}\\n" \\
        "for m in pkgutil.walk_packages(megacritic.__path__, 'megacritic.'):\\n" \\
        "    if m.name not in skip: importlib.import_module(m.name)\\n" \\
        "print(' '.join(m for m in sys.modules if m.split('.')[0] != 'megacritic' and '__main__' not in m))"
    upstream = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True,
                              check=True).stdout.split()
    for name in upstream + MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            pass  # not importable on its own (an alias another module registers); not watched then
    filters = list(warnings.filters)
    before = snapshot()
    entry_points = ("megacritic.cli", "megacritic.__main__")
    for name in library_modules():
        if name not in entry_points:
            importlib.import_module(name)
    same_filters = warnings.filters == filters
    from megacritic.config import MegatronConfig, tiny_model
    from megacritic.model.value_model import transformer_config
    from megacritic.parallel import ParallelLayout
    layout = ParallelLayout.from_config(MegatronConfig(pipeline_model_parallel_size=2), world_size=2)
    for on_cpu in (True, False):
        transformer_config(tiny_model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16), layout,
                           dtype=torch.float32, on_cpu=on_cpu)
    for name in entry_points:
        importlib.import_module(name)
    report(changed=changed(before, snapshot()), same_filters=same_filters)
    """
)

_PURE_CORE = textwrap.dedent(
    """
    import megacritic.losses, megacritic.advantages, megacritic.config
    import megacritic
    assert "CriticWorker" in dir(megacritic)
    report(megatron=sorted(m for m in sys.modules if m.split(".")[0] == "megatron"))
    """
)


def _script(body: str, *, on_cpu: bool = True, fused: bool = False, pretend_cuda: bool = False) -> str:
    setup = f"MARK = {_MARK!r}\nON_CPU, FUSED = {on_cpu}, {fused}\nMODULES = {sorted({m.split(':')[0] for m in ALWAYS | CPU | FUSED_CUDA})!r}\n"
    if pretend_cuda:
        setup += "torch.cuda.is_available = lambda: True\n"
    return _PRELUDE + setup + body


_SCENARIOS = {
    "cpu": _script(_APPLY, on_cpu=True, fused=False),
    "cuda_fused": _script(_APPLY, on_cpu=False, fused=True, pretend_cuda=True),
    "cuda_unfused": _script(_APPLY, on_cpu=False, fused=False, pretend_cuda=True),
    "wrong_version": _script(_WRONG_VERSION),
    "import": _script(_IMPORT),
    "pure_core": _script(_PURE_CORE),
}


def _run(body: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    assert proc.returncode == 0 and lines, (f"scenario failed (returncode {proc.returncode})\n--- stdout\n"
                                            f"{proc.stdout}\n--- stderr\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len(_MARK):])


@pytest.fixture(scope="module")
def results():
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(_run, body) for name, body in _SCENARIOS.items()}
        return {name: future.result() for name, future in futures.items()}


def _diff(changed, expected) -> str:
    changed = set(changed)
    return (f"not in the expected list: {sorted(changed - expected)}; "
            f"expected but unchanged: {sorted(expected - changed)}")


def test_apply_on_cpu_changes_exactly_the_listed_attributes(results):
    r = results["cpu"]
    assert set(r["changed"]) == ALWAYS | CPU, _diff(r["changed"], ALWAYS | CPU)
    assert r["new_modules"] == []


def test_apply_on_cuda_changes_exactly_the_listed_attributes(results):
    fused, unfused = results["cuda_fused"], results["cuda_unfused"]
    assert set(fused["changed"]) == ALWAYS | FUSED_CUDA, _diff(fused["changed"], ALWAYS | FUSED_CUDA)
    assert set(unfused["changed"]) == ALWAYS, _diff(unfused["changed"], ALWAYS)
    assert fused["new_modules"] == [] and unfused["new_modules"] == []


def test_apply_is_idempotent(results):
    for scenario in ("cpu", "cuda_fused", "cuda_unfused"):
        assert results[scenario]["again"] == [], scenario


def test_wrong_megatron_version_is_refused_before_any_change(results):
    r = results["wrong_version"]
    assert r["error"] is not None and "megatron-core 0.17.0 is installed" in r["error"], r["error"]
    assert r["changed"] == []


def test_wrong_megatron_version_error_names_installed_and_supported(monkeypatch):
    from megatron.core import package_info

    from megacritic import compat

    for version in ("0.17.0", "0.15.2", "1.16.0"):
        monkeypatch.setattr(package_info, "__version__", version)
        with pytest.raises(compat.UnsupportedVersion, match=rf"megatron-core {version} is installed.*0\.16\.x"):
            compat.require_supported_megatron()
    monkeypatch.setattr(package_info, "__version__", "0.16.9rc1")
    compat.require_supported_megatron()


def test_import_and_config_change_nothing_upstream(results):
    r = results["import"]
    assert r["changed"] == [], r["changed"]
    assert r["same_filters"], "importing megacritic changed the warning filters"


def test_pure_modules_import_without_megatron(results):
    assert results["pure_core"]["megatron"] == []
