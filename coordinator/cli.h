/* cli.h — the rekv CLI's subcommands (each an argc/argv main of its own) and their helpers. */
#ifndef REKV_COORDINATOR_CLI_H
#define REKV_COORDINATOR_CLI_H

#include <stdint.h>
#include <stddef.h>

int cli_generate(int argc, char **argv);
int cli_bench(int argc, char **argv);

/* Parses "1,2,3" into a malloc'd array; -EINVAL on anything else. */
int cli_parse_ids(const char *s, int32_t **ids, int *n);
/* Strict numeric option parsing; print "rekv: --name: ..." and return -1 on error. */
int cli_parse_int(const char *name, const char *s, long lo, long hi, long *out);
int cli_parse_float(const char *name, const char *s, double lo, double hi, double *out);

#endif
