/* metrics_scrape.h — scraping a daemon's Prometheus port from a test and checking what comes
 * back: a well-formed exposition (our own reader) and, when installed, `promtool check metrics`
 * (Debian's prometheus package; deploy/debian-packages.txt installs it in CI). */
#ifndef REKV_TESTS_METRICS_SCRAPE_H
#define REKV_TESTS_METRICS_SCRAPE_H

#include <stddef.h>

/* A TCP port on 127.0.0.1 free a moment ago (bound to port 0 and closed), for a daemon's
 * --metrics 127.0.0.1:PORT. */
int ms_free_port(void);

/* GET /metrics from 127.0.0.1:port, retrying the connection for up to 30 s while nothing listens;
 * fails the test unless the answer is 200 with an exposition body. Returns the body (malloc'd,
 * NUL-terminated). */
char *ms_scrape(int port);

/* Checks a text exposition: every sample's family has HELP and TYPE lines before it, each
 * family's samples are together, names and label sets are well-formed, values parse, a
 * histogram's samples are its _bucket (with le, cumulative, ending at +Inf), _sum and _count.
 * Returns the number of samples. */
int ms_check_exposition(const char *body, size_t n);

/* `promtool check metrics` on body: fails the test on any problem it reports. Without promtool it
 * prints why it skips and returns 77 — or fails when CI=true (CI must have it). 0 when checked. */
int ms_promtool(const char *body);

/* The value of the sample written exactly as `series` (name and, if any, {labels} as the daemon
 * writes them), or NaN when there is none. */
double ms_value(const char *body, const char *series);

#endif
