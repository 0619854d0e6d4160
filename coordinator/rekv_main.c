/* rekv_main.c — the rekv client CLI: dispatches to its subcommands. */
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "coordinator/cli.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: rekv <command> [options]\n"
               "commands:\n"
               "  generate   run a prompt through a model and print the continuation\n"
               "  bench      benchmarks (bench forward | bench kvstore), JSON output\n"
               "Run `rekv <command> --help` for a command's options.\n");
}

int main(int argc, char **argv)
{
    rekv_log_init_from_env();
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "generate") == 0)
        return cli_generate(argc - 1, argv + 1);
    if (strcmp(argv[1], "bench") == 0)
        return cli_bench(argc - 1, argv + 1);
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "rekv: unknown command \"%s\"\n", argv[1]);
    usage(stderr);
    return 2;
}
