/* rekv_main.c — the rekv client CLI: dispatches to its subcommands. */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/version.h"
#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_daemon.h"
#include "coordinator/cli/cli_profile.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: rekv <command> [options]\n"
               "commands:\n"
               "  generate   run a prompt through a model in this process, print the continuation\n"
               "  run        start kvstore, gpuworker and coordinator locally; serve until Ctrl-C\n"
               "  submit     submit a job to the coordinator and stream its tokens\n"
               "  status     a job's state, or the queue's\n"
               "  cancel     cancel a job\n"
               "  stats      the coordinator's counters\n"
               "  profile    measure (or show the cached) link, GEMM and attention speeds\n"
               "  bench      benchmarks (bench forward | decode | kvstore), JSON output\n"
               "  eval       teacher-forced NLL of a text in a mode, bytes moved, agreement\n"
               "  skew       make (or show the cached) InfiniGen skewing matrices of a model\n"
               "  heads      make (or show the cached) CLO head profile of a model\n"
               "Run `rekv <command> --help` for a command's options; `rekv --version` prints the\n"
               "version.\n");
}

int main(int argc, char **argv)
{
    rekv_log_init_from_env();
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    static const struct {
        const char *name;
        int (*fn)(int, char **);
    } cmds[] = {{"generate", cli_generate}, {"bench", cli_bench},    {"eval", cli_eval},
                {"skew", cli_skew},         {"heads", cli_heads},    {"run", cli_run},
                {"submit", cli_submit},     {"status", cli_status},  {"cancel", cli_cancel},
                {"stats", cli_stats},       {"profile", cli_profile}};
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++)
        if (strcmp(argv[1], cmds[i].name) == 0) {
            static char name[64]; /* "rekv generate: ..." in its messages */
            cli_name_command(argv + 1, "rekv", name, sizeof(name));
            return cmds[i].fn(argc - 1, argv + 1);
        }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
        printf("rekv %s\n", rekv_version());
        return 0;
    }
    fprintf(stderr, "rekv: unknown command \"%s\"\n", argv[1]);
    usage(stderr);
    return 2;
}
