/* Whether this CPU runs the kernels: AVX-512 F, BW, VL and BF16. Built without any AVX-512 flag
 * (its own object in the library), so asking never executes an instruction the CPU may lack: one
 * library built on any x86-64 machine picks its path where it runs. */
int kvforge_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

/* The hash of the sources the library was built from (setup.py's `sources_hash`). */
const char *kvforge_sources(void) { return KVFORGE_SOURCES; }
