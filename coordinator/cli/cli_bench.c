/* cli_bench.c — `rekv bench`: benchmarks that print one JSON object. Times mean something as ratios
 * measured in the same run, so every benchmark measures its baseline alongside. This file picks
 * the benchmark; each lives in a file of its own (cli_bench_forward.c, cli_bench_decode.c,
 * cli_bench_serve.c, cli_bench_http.c, cli_bench_remote.c, and the kvstore's in kvstore/bench.c). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "coordinator/cli/cli.h"
#include "coordinator/cli/cli_bench.h"
#include "coordinator/cli/cli_daemon.h"
#include "kvstore/kvstore.h"

unsigned long long cli_peak_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof(line), f))
        if (sscanf(line, "VmHWM: %llu kB", &kb) == 1)
            break;
    if (f)
        fclose(f);
    return kb * 1024;
}

int cli_peak_rss_reset(void)
{
    int fd = open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    int rc = write(fd, "5", 1) == 1 ? 0 : -errno;
    close(fd);
    return rc;
}

int cli_bench(int argc, char **argv)
{
    static const struct {
        const char *name;
        int (*fn)(int, char **);
    } benches[] = {{"forward", cli_bench_forward},
                   {"decode", cli_bench_decode},
                   {"serve", cli_bench_serve},
                   {"http", cli_bench_http},
                   {"remote", cli_bench_remote},
                   {"kvstore", rekv_kvstore_bench_main}};
    for (size_t i = 0; argc >= 2 && i < sizeof(benches) / sizeof(benches[0]); i++)
        if (strcmp(argv[1], benches[i].name) == 0) {
            static char name[96]; /* "rekv bench decode: ..." in its messages */
            cli_name_command(argv + 1, argv[0], name, sizeof(name));
            return benches[i].fn(argc - 1, argv + 1);
        }
    int help = argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0);
    if (argc >= 2 && !help)
        fprintf(stderr, "%s: unknown benchmark '%s'\n", argv[0], argv[1]);
    fprintf(help ? stdout : stderr,
            "usage: rekv bench forward|decode|serve|http|remote|kvstore [options] --json\n"
            "Run `rekv bench BENCH --help` for a benchmark's options.\n");
    return help ? 0 : 2;
}
