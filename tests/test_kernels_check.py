"""`hipengine kernels check`: every kernel unit compiles for gfx942 (clang-19) and sm_90 (NVRTC), warnings as
errors; and the checker itself reports failures, warnings and missing compilers correctly."""
import os
import shutil
from types import SimpleNamespace

import pytest

from hipengine.errors import DeviceError
from hipengine.gpu import backend_cuda, check

HAVE_CLANG = bool(shutil.which(check.CLANG) and shutil.which(check.READELF))
REQUIRE_CLANG = bool(os.environ.get("HIPENGINE_REQUIRE_CLANG"))
HAVE_NVRTC = backend_cuda.nvrtc_available()


def _targets():
    out = []
    if HAVE_CLANG or REQUIRE_CLANG:  # CI sets HIPENGINE_REQUIRE_CLANG: a missing clang-19 must fail there
        out.append("gfx942")
    if HAVE_NVRTC:
        out.append("sm_90")
    return out


@pytest.mark.skipif(not _targets(), reason="neither clang-19 nor NVRTC installed")
def test_all_kernel_units_compile(capsys):
    rc = check.run(SimpleNamespace(arch=_targets(), skip_missing=False, no_cache=False, jobs=2))
    out, err = capsys.readouterr()
    assert rc == 0, out + err
    assert " FAIL " not in out


GOOD = '#include "port.h"\nHE_KERNEL(256) good(float* x) { x[he_thread_idx()] = 1.0f; }\n'
WARN = '#include "port.h"\nHE_KERNEL(256) warn(float* x) { int unused = 3; x[he_thread_idx()] = 1.0f; }\n'
BAD = '#include "port.h"\nHE_KERNEL(256) bad(float* x) { x[he_thread_idx()] = no_such_thing; }\n'


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    files = {}
    for name, text in (("good", GOOD), ("warn", WARN), ("bad", BAD)):
        files[name] = tmp_path / f"{name}.hip"
        files[name].write_text(text)
    return files


@pytest.mark.parametrize("target", ["gfx942", "sm_90"])
def test_checker_reports_errors_and_warnings(kernels, target):
    if target == "gfx942" and not HAVE_CLANG:
        pytest.skip("clang-19 not installed")
    if target == "sm_90" and not HAVE_NVRTC:
        pytest.skip("NVRTC not installed")
    res = {r.file.rsplit("/", 1)[-1]: r for r in check.check_all([target], list(kernels.values()))}
    assert res["good.hip"].ok, res["good.hip"].message
    assert res["good.hip"].registers
    assert not res["warn.hip"].ok and "unused" in res["warn.hip"].message
    assert not res["bad.hip"].ok and "no_such_thing" in res["bad.hip"].message
    # Second run: the success is cached, failures are re-reported.
    again = {r.file.rsplit("/", 1)[-1]: r for r in check.check_all([target], list(kernels.values()))}
    assert again["good.hip"].cached and not again["bad.hip"].ok


def test_missing_clang_is_an_error_unless_skipped(kernels, monkeypatch):
    monkeypatch.setattr(check, "CLANG", "clang++-does-not-exist")
    with pytest.raises(DeviceError, match="clang"):
        check.check_all(["gfx942"], [kernels["good"]])
    res = check.check_all(["gfx942"], [kernels["good"]], skip_missing=True)
    assert all(r.skipped and r.ok for r in res)


def test_unknown_target():
    with pytest.raises(DeviceError, match="unknown target"):
        check.check_all(["gfx1100"], [])


@pytest.mark.skipif(not HAVE_NVRTC, reason="NVRTC not installed")
def test_cli_entry_point(capsys):
    from hipengine.cli import main

    assert main(["kernels", "check", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "ops/probe.hip" in out and "sm_90" in out and "0 failed" in out


@pytest.mark.skipif(not _targets(), reason="neither clang-19 nor NVRTC installed")
@pytest.mark.parametrize("lanes", [1, 2, 4, 16, 32])
def test_attention_builds_for_every_head_dim_class(tmp_path, monkeypatch, lanes):
    """The attention module is compiled per head_dim (HE_ATTN_LPR = attn_lanes(hd), HE_ATTN_HD = hd: ops.
    attention_defines, with either softmax max: HE_ATTN_WARP_MAX); `kernels check` builds the generic unit (8
    lanes, hd a run-time argument, the warp's max): the per-hd builds must compile too, warnings as errors,
    on both targets."""
    from hipengine.gpu.ops import attn_lanes

    assert [attn_lanes(hd) for hd in (8, 16, 24, 32, 64, 128, 256)] == [1, 2, 4, 4, 8, 16, 32]
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / f"attention_lpr{lanes}.hip"
    warp_max = {1: 0, 2: 1, 4: 0, 16: 1, 32: 0}[lanes]  # both softmax builds (ops.attn_warp_max)
    unit.write_text(f'#define HE_ATTN_LPR {lanes}\n#define HE_ATTN_HD {8 * lanes}\n'
                    f'#define HE_ATTN_WARP_MAX {warp_max}\n#include "ops/attention_decode.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


@pytest.mark.skipif(not _targets(), reason="neither clang-19 nor NVRTC installed")
@pytest.mark.parametrize("hd,kv_f16", [(16, 0), (64, 0), (64, 1), (128, 0)])
def test_attention_mma_build_compiles(tmp_path, monkeypatch, hd, kv_f16):
    """The decode split on the matrix cores (HE_ATTN_MMA=1: ops.attn_mma, head_dim a multiple of 16) is a build
    of its own: it compiles warnings-as-errors for gfx942 (wave64, MFMA) and sm_90 (mma.sync), bf16 and fp16
    KV caches, the head sizes whose tiles a warp's lanes do not divide evenly (hd 16) included."""
    from hipengine.gpu.ops import attn_lanes

    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / f"attention_mma_hd{hd}_f{kv_f16}.hip"
    unit.write_text(f'#define HE_ATTN_LPR {attn_lanes(hd)}\n#define HE_ATTN_HD {hd}\n#define HE_ATTN_MMA 1\n'
                    f'#define HE_KV_F16 {kv_f16}\n#include "ops/attention_decode.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


@pytest.mark.parametrize("tp", [0, 1])
def test_monokernel_attention_mma_build_compiles(tmp_path, monkeypatch, tp):
    """The monokernel with the matrix-core split (HE_ATTN_MMA=1 at hd 64, as ops.attention_defines gives it: a
    call between compiler fences), alone and with the LL exchange (MK_TP=1), compiles warnings-as-errors for
    gfx942 and sm_90."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / f"decode_attn_mma_tp{tp}.hip"
    unit.write_text(f'#define HE_ATTN_HD 64\n#define HE_ATTN_MMA 1\n#define MK_TP {tp}\n'
                    '#include "monokernel/decode.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


def test_monokernel_tensor_parallel_build_compiles(tmp_path, monkeypatch):
    """The tensor-parallel monokernel is a build of its own (MK_TP=1: the LL exchange of
    monokernel/tp_exchange.h); `kernels check` builds the default, so this one must compile too, warnings as
    errors, for gfx942 (wave64) and sm_90."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / "decode_tp.hip"
    unit.write_text('#define MK_TP 1\n#include "monokernel/decode.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


@pytest.mark.parametrize("tp", [0, 1])
def test_monokernel_long_context_build_compiles(tmp_path, monkeypatch, tp):
    """The long-context build (HE_ATTN_Q_REGS=1: the split's q slices in registers, hipengine/gpu/monokernel.py
    q_regs_build), alone and with the LL exchange (MK_TP=1), compiles warnings-as-errors for both targets."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / f"decode_qregs_tp{tp}.hip"
    unit.write_text(f'#define HE_ATTN_Q_REGS 1\n#define MK_TP {tp}\n#include "monokernel/decode.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


@pytest.mark.skipif(not _targets(), reason="neither clang-19 nor NVRTC installed")
def test_matvec_rows1_build_compiles(tmp_path, monkeypatch):
    """The per-op path builds matvec.hip a second time for matvec_rows1 (HE_MATVEC_UNROLL = ops.
    MATVEC_ROWS1_UNROLL); `kernels check` builds the default, so this one must compile too, warnings as errors,
    for gfx942 (wave64) and sm_90."""
    from hipengine.gpu.ops import MATVEC_ROWS1_UNROLL

    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / "matvec_rows1.hip"
    unit.write_text(f'#define HE_MATVEC_UNROLL {MATVEC_ROWS1_UNROLL}\n#include "ops/matvec.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


@pytest.mark.skipif(not _targets(), reason="neither clang-19 nor NVRTC installed")
def test_attention_prefill_qtiles_build_compiles(tmp_path, monkeypatch):
    """attention_prefill.hip with 4 query tiles per block (HIPENGINE_AP_QTILES=4: blocks of up to 16 warps,
    1,024 threads on gfx942's wave64) compiles warnings-as-errors for both targets."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / "attention_prefill_qt4.hip"
    unit.write_text('#define HE_AP_QTILES 4\n#include "ops/attention_prefill.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


def test_pdl_late_builds_compile(tmp_path, monkeypatch):
    """The HE_PDL_LATE builds of the decode-step modules (Ops._late: ops.pdl_trigger_levels — after the wait;
    the matvecs also once staged) compile warnings-as-errors for both targets."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    units = []
    for name, level in (("matvec", 1), ("attention_decode", 1), ("matvec", 2)):
        unit = tmp_path / f"{name}_late{level}.hip"
        unit.write_text(f'#define HE_PDL_LATE {level}\n#include "ops/{name}.hip"\n')
        units.append(unit)
    for r in check.check_all(_targets(), units):
        assert r.ok, f"{r.target}: {r.message}"


def _check_units(tmp_path, monkeypatch, units: dict) -> None:
    """Compile units {file name: source text} (defines, then an #include of a kernel unit) for every target."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    paths = []
    for name, text in units.items():
        paths.append(tmp_path / name)
        paths[-1].write_text(text)
    for r in check.check_all(_targets(), paths):
        assert r.ok, f"{r.file} {r.target}: {r.message}"


def test_lean_builds_compile(tmp_path, monkeypatch):
    """The builds the host picks by model (compile_args / Ops._whole): the stream without its predicated paths
    (HE_MV_WHOLE_PAIRS, rows that are whole pairs), the Qwen3 q/k-norm stage (MK_QK_NORM) and the fine = 2
    combine (MK_FINE2), with the cold-branch hints (HE_COLD_HINTS), compile warnings-as-errors for gfx942 and
    sm_90, the monokernel and the per-op matvecs."""
    _check_units(tmp_path, monkeypatch, {
        "decode_lean.hip": "#define HE_MV_WHOLE_PAIRS 1\n#define MK_QK_NORM 1\n#define MK_FINE2 1\n#define HE_COLD_HINTS 1\n"
                           '#include "monokernel/decode.hip"\n',
        "matvec_whole.hip": '#define HE_MV_WHOLE_PAIRS 1\n#include "ops/matvec.hip"\n'})


def test_fused_mlp_builds_compile(tmp_path, monkeypatch):
    """The opt-in fused MLP (HIPENGINE_FUSED_MLP=1, ops/mlp.hip): the monokernel's MK_FUSED_MLP build for the
    default model's hidden size (3 vectors per lane on NVIDIA, 2 on wave64: HE_MLP_DVEC=3 covers both) and the
    per-op matvecs with the fixed-point addend (HE_MV_X_FX, HE_MV_RES_FX) compile warnings-as-errors for gfx942
    and sm_90 (ops/mlp.hip itself is a unit of the plain check)."""
    _check_units(tmp_path, monkeypatch, {
        "decode_fused_mlp.hip": "#define MK_FUSED_MLP 1\n#define HE_MLP_DVEC 3\n#define HE_MV_WHOLE_PAIRS 1\n"
                                '#define HE_COLD_HINTS 1\n#include "monokernel/decode.hip"\n',
        "matvec_fx.hip": '#define HE_MV_X_FX 1\n#define HE_MV_RES_FX 1\n#include "ops/matvec.hip"\n'})


def test_attn_early_build_compiles(tmp_path, monkeypatch):
    """The opt-in build with the attention splits' first K/V requests before the QKV barrier's wait
    (MK_ATTN_EARLY=1, v72: the split bodies' kEarly wait as a functor), on the Llama and the Qwen3 (q/k-norm)
    paths, compiles warnings-as-errors for gfx942 and sm_90."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / "decode_attn_early.hip"
    unit.write_text('#define MK_ATTN_EARLY 1\n#define MK_QK_NORM 1\n#define HE_MV_WHOLE_PAIRS 1\n#define HE_COLD_HINTS 1\n'
                    '#include "monokernel/decode.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


def test_gate_up_l2_probe_build_compiles(tmp_path, monkeypatch):
    """The MK_GU_L2 probe builds (the blocks without an attention split prefetch gate/up rows into L2; port.h
    he_prefetch_l2_bulk, a no-op on gfx942), all at once and paced (MK_GU_L2_GAP), compile warnings-as-errors for
    gfx942 and sm_90."""
    _check_units(tmp_path, monkeypatch, {
        "decode_gu_l2.hip": "#define MK_GU_L2 2\n#define HE_MV_WHOLE_PAIRS 1\n#define HE_COLD_HINTS 1\n"
                            '#include "monokernel/decode.hip"\n',
        "decode_gu_l2_paced.hip": "#define MK_GU_L2 1\n#define MK_GU_L2_GAP 148\n#define HE_MV_WHOLE_PAIRS 1\n"
                                  '#define HE_COLD_HINTS 1\n#include "monokernel/decode.hip"\n'})


def test_head_screen_build_compiles(tmp_path, monkeypatch):
    """The screened LM head's monokernel build (MK_HEAD_SCREEN=1, HIPENGINE_MK_HEAD_SCREEN: ops/head_screen.hip's
    stage and pick in the generation loop), lean and with the predicated stream, compiles warnings-as-errors for
    gfx942 and sm_90 (ops/head_screen.hip itself, with its test kernels, is a unit of the plain check)."""
    _check_units(tmp_path, monkeypatch, {
        "decode_screen.hip": "#define MK_HEAD_SCREEN 1\n#define HE_MV_WHOLE_PAIRS 1\n#define HE_COLD_HINTS 1\n"
                             '#include "monokernel/decode.hip"\n',
        "decode_screen_plain.hip": '#define MK_HEAD_SCREEN 1\n#include "monokernel/decode.hip"\n'})


def test_monokernel_profile_build_compiles(tmp_path, monkeypatch):
    """The stage-profile build (MK_PROFILE=1: HIPENGINE_MK_PROFILE, its sums in shared memory) is a build of its
    own; it compiles warnings-as-errors for gfx942 and sm_90."""
    monkeypatch.setenv("HIPENGINE_CACHE", str(tmp_path / "cache"))
    unit = tmp_path / "decode_profile.hip"
    unit.write_text('#define MK_PROFILE 1\n#include "monokernel/decode.hip"\n')
    for r in check.check_all(_targets(), [unit]):
        assert r.ok, f"{r.target}: {r.message}"


def test_o_group_build_compiles(tmp_path, monkeypatch):
    """The grouped O-proj's monokernel build (MK_O_GROUP=1, HIPENGINE_MK_OGROUP: ops/matvec_group.hip's share of
    Wo per KV-head group, the fixed-point addend in the gate/up prologue and the down-proj's residual rows), with
    the screened head as the default runs it, lean and as a profile build, compiles warnings-as-errors for gfx942
    (G·hd = 256: 32 lanes per row of a wave64 load's two) and sm_90."""
    _check_units(tmp_path, monkeypatch, {
        "decode_o_group.hip": "#define MK_O_GROUP 1\n#define HE_ATTN_HD 64\n#define MK_HEAD_SCREEN 1\n#define HE_MV_WHOLE_PAIRS 1\n"
                              '#define HE_COLD_HINTS 1\n#include "monokernel/decode.hip"\n',
        "decode_o_group_profile.hip": "#define MK_O_GROUP 1\n#define HE_ATTN_HD 64\n#define MK_PROFILE 1\n"
                                      '#include "monokernel/decode.hip"\n',
        "decode_o_group_2pass.hip": "#define MK_O_GROUP 1\n#define HE_ATTN_HD 64\n#define HE_NORM_FX_ONE_PASS 0\n"
                                    '#define HE_MV_WHOLE_PAIRS 1\n#define HE_COLD_HINTS 1\n#include "monokernel/decode.hip"\n'})


def test_norm_gamma_early_builds_compile(tmp_path, monkeypatch):
    """The RMSNorm prologues' other forms (ops/rmsnorm.hip HE_NORM_GAMMA_EARLY: 0, session 42's — gamma after the sum;
    1, the early gamma in the fixed-point form only; the default 2 is every other build here) compile
    warnings-as-errors for gfx942 and sm_90, in the monokernel (mk_sweep 35 / 36) and in the per-op matvec module."""
    base = "#define MK_O_GROUP 1\n#define MK_QFLOW 1\n#define HE_ATTN_HD 64\n#define HE_ATTN_MMA 1\n#define MK_HEAD_SCREEN 1\n" \
           "#define HE_MV_WHOLE_PAIRS 1\n#define HE_COLD_HINTS 1\n"
    _check_units(tmp_path, monkeypatch, {
        **{f"decode_norm_ge{v}.hip": base + f"#define HE_NORM_GAMMA_EARLY {v}\n" + '#include "monokernel/decode.hip"\n'
           for v in (0, 1)},
        "matvec_norm_ge0.hip": '#define HE_NORM_GAMMA_EARLY 0\n#include "ops/matvec.hip"\n'})


def test_q_flow_build_compiles(tmp_path, monkeypatch):
    """The LL-fed attention's monokernel build (MK_QFLOW=1, the default where it applies since session 41: the QKV
    epilogue's LL words, the splits' polls on the matrix-core body, no QKV barrier), lean and as a profile build,
    compiles warnings-as-errors for gfx942 (wave64, its MFMA attention tiles) and sm_90."""
    base = "#define MK_O_GROUP 1\n#define MK_QFLOW 1\n#define HE_ATTN_HD 64\n#define HE_ATTN_MMA 1\n"
    _check_units(tmp_path, monkeypatch, {
        "decode_q_flow.hip": base + "#define MK_HEAD_SCREEN 1\n#define HE_MV_WHOLE_PAIRS 1\n#define HE_COLD_HINTS 1\n"
                             '#include "monokernel/decode.hip"\n',
        "decode_q_flow_profile.hip": base + '#define MK_PROFILE 1\n#include "monokernel/decode.hip"\n'})


def test_fresh_combine_builds_compile(tmp_path, monkeypatch):
    """The splits without the newest row and the combine that adds it (attention_decode.hip HE_ATTN_FRESH_COMBINE:
    ops.attn_fresh_combine, both paths): the per-op module on the FMA and the matrix-core bodies, and the monokernel
    with its three combines — the grouped O-proj's from the LL words (MK_QFLOW), the same from plain loads, and the
    last split block's (plain O-proj, tensor-parallel build) — compile warnings-as-errors for gfx942 and sm_90."""
    fc = "#define HE_ATTN_FRESH_COMBINE 1\n#define HE_ATTN_HD 64\n"
    mk = fc + "#define HE_ATTN_MMA 1\n#define MK_HEAD_SCREEN 1\n#define HE_MV_WHOLE_PAIRS 1\n"
    _check_units(tmp_path, monkeypatch, {
        "attention_fc.hip": fc + '#define HE_ATTN_LPR 8\n#include "ops/attention_decode.hip"\n',
        "attention_fc_mma.hip": fc + '#define HE_ATTN_LPR 8\n#define HE_ATTN_MMA 1\n#include "ops/attention_decode.hip"\n',
        "decode_fc_q_flow.hip": mk + '#define MK_O_GROUP 1\n#define MK_QFLOW 1\n#include "monokernel/decode.hip"\n',
        "decode_fc_o_group.hip": mk + '#define MK_O_GROUP 1\n#include "monokernel/decode.hip"\n',
        "decode_fc_tp.hip": mk + '#define MK_TP 1\n#include "monokernel/decode.hip"\n'})


def test_start_l2_build_compiles(tmp_path, monkeypatch):
    """The next stage's second pair asked of L2 as every layer's grid barrier opens (decode.hip MK_START_L2=7; the kernel's
    default is 4, the next layer's QKV only), whole pairs and half pairs (MK_START_L2_HALF=7: the host's short-context
    build on NVIDIA, monokernel.start_l2_defines): the q-flow build with it compiles warnings-as-errors for gfx942
    (where the prefetch is nothing) and sm_90 (cp.async.bulk.prefetch.L2)."""
    base = ("#define MK_O_GROUP 1\n#define MK_QFLOW 1\n#define HE_ATTN_HD 64\n#define HE_ATTN_MMA 1\n"
            "#define HE_ATTN_FRESH_COMBINE 1\n#define MK_HEAD_SCREEN 1\n#define HE_MV_WHOLE_PAIRS 1\n")
    _check_units(tmp_path, monkeypatch, {
        "decode_start_l2.hip": base + "#define MK_START_L2 7\n#include \"monokernel/decode.hip\"\n",
        "decode_start_l2_half.hip": base + "#define MK_START_L2 7\n#define MK_START_L2_HALF 7\n"
                                           "#include \"monokernel/decode.hip\"\n"})
