"""bench.static's readers of nvdisasm and ptxas output, on small recorded samples."""

from bench import static

SASS = """
        .section        .text.k,"ax",@progbits
        .text.k:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/              @!P1 LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LDG.E.U16 R8, desc[UR4][R2.64+0x10] ;
        /*0040*/                   FFMA R4, R4, R5, R6 ;
        /*0050*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*0060*/                   ISETP.GE.AND P1, PT, R0, R9, PT ;
        /*0070*/              @!P1 BRA `(.L_x_1) ;
.L_x_0:
        /*0080*/                   EXIT ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
        /*00a0*/                   NOP;
"""

PTXAS = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'
ptxas info    : Function properties for _Z1kv
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 380 bytes cmem[0]
"""
RESOURCES = {"registers": 1, "spill_bytes": 0, "shared_bytes": 0}


def test_hot_loop_is_the_span_of_the_backward_branch():
    (instructions,) = static.sass_functions(SASS).values()
    assert len(instructions) == 10  # NOP padding is not counted
    loop = static.hot_loop(instructions)
    # the self-loop trap is no loop
    assert len(loop) == 6 and loop[0].startswith("@!P1 LDG.E.128") and loop[-1].startswith("@!P1 BRA")
    assert static.count_memory(loop) == {"ldg": 2, "ldg128": 1, "stg": 1, "stg128": 1}
    report = static.analyse("k", "k", instructions, RESOURCES, 2.0, budget=2.5)
    assert (report.loop_instructions, report.instructions_per_element) == (6, 3.0)
    assert report.problems() == ["3.0 instructions per element > budget 2.5"]


def test_a_kernel_without_a_loop_counts_all_its_instructions():
    (instructions,) = static.sass_functions(SASS.replace("@!P1 BRA `(.L_x_1)", "BRA `(.L_x_0)")).values()
    assert static.hot_loop(instructions) is None
    assert static.analyse("k", "k", instructions, RESOURCES, 1.0).instructions_per_element == 10


def test_ptxas_log_and_problems():
    assert static.parse_ptxas_log(PTXAS) == {"_Z1kv": {"registers": 40, "spill_bytes": 8, "shared_bytes": 1024}}
    report = static.KernelReport(
        "k",
        "k",
        40,
        8,
        0,
        ldg128=0,
        ldg=2,
        stg128=0,
        stg=0,
        loop_instructions=None,
        elements_per_thread=None,
        instructions_per_element=None,
        vector_loads_expected=True,
    )
    assert report.problems() == ["8 bytes spilled", "hot-loop global loads not all 128-bit (0 of 2)"]
