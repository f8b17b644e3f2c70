"""seg-bench's text report (printed without --json)."""


def format_report(r: dict) -> str:
    """A human-readable summary of runner.run's result."""
    lines = [
        f"seg-bench: {r['backbone']} OS{r['output_stride']}, crop {r['crop_size'][0]}x{r['crop_size'][1]}, "
        f"global batch {r['global_batch']}, {r['precision']}, jit_compile {r['jit_compile']}, input {r['input']}",
        f"machine: {r['machine']['cpu']}, {r['machine']['usable_cpus']} cpus, TF {r['machine']['tensorflow']}",
        f"timing: {r['warmup_steps']} warm-up steps, then the median of {r['windows']} windows of "
        f"{r['steps_per_window']} steps",
        "",
        "towers  images/s  per tower  step ms  efficiency  input wait  GFLOP/s  of peak  cpu ms/step  cores",
    ]
    for t in r["towers"]:
        util = f"{100 * t['flops_utilization']:6.1f}%" if t["flops_utilization"] is not None else "     -"
        lines.append(f"{t['gpus']:6d}  {t['images_per_sec']:8.2f}  {t['images_per_sec_per_tower']:9.2f}  "
                     f"{t['step_time_ms']:7.0f}  {t['efficiency']:10.3f}  {100 * t['input_wait_fraction']:9.1f}%  "
                     f"{t['achieved_gflops']:7.1f}  {util}  {t['cpu_ms_per_step']:11.0f}  {t['cores_busy']:5.2f}")
    lines.append("")
    if r["input_images_per_sec"] is not None:
        lines.append(f"input pipeline alone: {r['input_images_per_sec']:.1f} images/s")
    f = r["flops"]
    lines.append(f"train step: {f['train_gflop_per_image']:.3f} GFLOP/image "
                 f"(forward {f['forward_gflop_per_image']:.3f}, "
                 f"ratio {f['train_to_forward']:.2f}); {f['method']}")
    if r["peak"]:
        p = r["peak"]
        lines.append(f"measured peak ({p['dtype']}): matmul {p['matmul_gflops']:.0f} GFLOP/s, 3x3 conv "
                     f"{p['conv3x3_gflops']:.0f} GFLOP/s -> peak {p['peak_gflops']:.0f}")
    for v in r.get("variants", []):
        t = v["towers"][-1]
        util = f", {100 * t['flops_utilization']:.1f}% of peak" if t["flops_utilization"] is not None else ""
        lines.append(f"variant {v['name']}: {t['images_per_sec']:.2f} images/s at {t['gpus']} tower(s), step "
                     f"{t['step_time_ms']:.0f} ms, input wait {100 * t['input_wait_fraction']:.1f}%{util}; "
                     f"speedup {r['speedup_vs_first_variant'][v['name']]:.3f}x "
                     f"(by CPU time {r['cpu_speedup_vs_first_variant'][v['name']]:.3f}x)")
    for v in r.get("variants") or [{"name": "", "towers": r["towers"]}]:
        for t in v["towers"]:
            prof = t.get("op_profile")
            if prof:
                top = ", ".join(f"{k} {share:.0%}" for k, _, share in prof["top_ops"][:6])
                lines.append(f"op time {v['name']} gpus={t['gpus']}: convolutions {prof['conv_share_of_op_time']:.0%} "
                             f"of {prof['op_time_ms_per_step']:.0f} ms/step; top: {top}")
    if r.get("warmup_steps_to_steady") is not None:
        more = "" if r["warmup_reached_steady"] else " (not reached: more --warmup)"
        lines.append(f"warm-up ({r['warmup_runner']}): {r['warmup_steps_to_steady']} steps until the step time is "
                     f"within 10% of steady state{more}"
                     f", {r['launch_to_steady_s']:.1f}s after launch ({r['build_to_steady_s']:.1f}s after building)")
    lines.append(f"efficiency = {r['efficiency_definition']}")
    lines.append(f"input wait = {r['input_wait_definition']}")
    lines.append(f"peak resident memory: {r['peak_rss_mb']:.0f} MiB ({r['peak_rss_scope']})")
    return "\n".join(lines)


def format_input_only(result: dict) -> str:
    """The report of seg-bench --input-only (runner.run_input_only's result)."""
    inp, floor = result["input"], result["decode_floor"]
    cache = (f"; first pass {inp['first_pass_images_per_sec']:.1f} images/s, cache {inp['cache_mb']:.0f} MiB"
             if result["cache"] else "")
    return (f"input pipeline alone: {inp['images_per_sec']:.1f} images/s, {inp['cores_busy']:.2f} cores busy "
            f"(global batch {result['global_batch']}, data.cache {result['cache']}{cache})\n"
            f"                    {'images/s':>9} {'cores busy':>11} {'CPU ms/sample':>14}\n"
            f"input pipeline    {inp['images_per_sec']:9.1f} {inp['cores_busy']:11.2f} "
            f"{inp['cpu_ms_per_sample']:14.1f}\n"
            f"decode only       {floor['images_per_sec']:9.1f} {floor['cores_busy']:11.2f} "
            f"{floor['cpu_ms_per_sample']:14.1f}\n"
            f"CPU per sample: {result['cpu_per_sample_vs_floor']:.2f}x the decode-only floor (the same "
            "samples, decoded by the reader's decoders, no augmentation)")
