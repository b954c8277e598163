/* LD_PRELOAD shim: the process's CPUID reports an AVX2-class x86 CPU (no AVX-512, no VNNI),
 * so onnxruntime, numpy and anything else that dispatches on CPUID pick the kernels such a
 * CPU runs, on the same hardware. Built and used by tests/support/avx2_cpu.py.
 *
 * How: Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID, 0; /proc/cpuinfo lists
 * cpuid_fault) makes every CPUID instruction trap; the SIGSEGV handler runs the real
 * instruction with faulting briefly off, clears the feature bits below and steps over it.
 * Threads inherit the faulting; exec clears it, and the preloaded constructor sets it again.
 * The loader's own dispatch (glibc's string functions) ran before the constructor and keeps
 * its choice. A process that installs its own SIGSEGV handler later (Python's faulthandler,
 * pytest's) would take the traps: run such things with faulthandler off. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_SET_CPUID_ 0x1012

static long cpuid_faulting(int on) { return syscall(SYS_arch_prctl, ARCH_SET_CPUID_, on ? 0ul : 1ul); }

#define BIT(n) (1u << (n))

static void on_segv(int sig, siginfo_t *info, void *raw) {
    (void)sig;
    (void)info;
    ucontext_t *uc = raw;
    greg_t *r = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)r[REG_RIP];
    if (ip[0] != 0x0f || ip[1] != 0xa2) { /* a real fault: the default action, as without us */
        signal(SIGSEGV, SIG_DFL);
        return;
    }
    uint32_t leaf = (uint32_t)r[REG_RAX], sub = (uint32_t)r[REG_RCX], a, b, c, d;
    cpuid_faulting(0);
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(leaf), "c"(sub));
    cpuid_faulting(1);
    if (leaf == 7 && sub == 0) {
        /* AVX-512 F DQ IFMA PF ER CD BW VL */
        b &= ~(BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31));
        /* AVX-512 VBMI VBMI2 VNNI BITALG VPOPCNTDQ */
        c &= ~(BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14));
        /* AVX-512 4VNNIW 4FMAPS VP2INTERSECT FP16; AMX BF16 TILE INT8 */
        d &= ~(BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25));
    } else if (leaf == 7 && sub == 1) {
        a &= ~(BIT(4) | BIT(5) | BIT(23));  /* AVX-VNNI, AVX512_BF16, AVX-IFMA */
        d &= ~(BIT(4) | BIT(5) | BIT(10));  /* AVX-VNNI-INT8, AVX-NE-CONVERT, AVX-VNNI-INT16 */
    }
    r[REG_RAX] = a;
    r[REG_RBX] = b;
    r[REG_RCX] = c;
    r[REG_RDX] = d;
    r[REG_RIP] += 2;
}

__attribute__((constructor)) static void install(void) {
    struct sigaction sa = {0};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGSEGV, &sa, NULL) != 0 || cpuid_faulting(1) != 0) {
        fputs("avx2_only: this kernel or CPU has no CPUID faulting (grep cpuid_fault /proc/cpuinfo)\n", stderr);
        _exit(3);
    }
}
