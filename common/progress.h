/* progress.h — progress of long work (synth, profile, bench, eval, long local generations) on a
 * program's stderr: a bar redrawn in place on a terminal, a plain line at every tenth of the work
 * otherwise (a log, a pipe: lines a reader can count), nothing when the program is quiet (--json
 * on stdout). Library code never gets a stream: it reports through a rekv_progress_fn the program
 * passes in (rekv_progress_cb, with a rekv_progress as its argument, is one), and only programs
 * make a rekv_progress. Not thread-safe: one per piece of work, updated from one thread.
 *
 * Only long work shows: nothing is written before the work has run REKV_PROGRESS_DELAY_NS, so a
 * quick run's stderr is what it always was. $REKV_PROGRESS=1 shows progress from the start (tests
 * count its lines that way), $REKV_PROGRESS=0 never. */
#ifndef REKV_COMMON_PROGRESS_H
#define REKV_COMMON_PROGRESS_H

#include <stdint.h>
#include <stdio.h>

#define REKV_PROGRESS_DELAY_NS 2000000000ull /* 2 s */

/* What library code calls as work advances: done of total units (total 0: unknown). */
typedef void (*rekv_progress_fn)(void *arg, uint64_t done, uint64_t total);

typedef enum rekv_progress_style {
    REKV_PROGRESS_QUIET = 0, /* writes nothing */
    REKV_PROGRESS_LINES = 1, /* a line per tenth of a known total; every 5 s when unknown */
    REKV_PROGRESS_BAR = 2,   /* one line redrawn with \r, at most every 100 ms, ended by end */
} rekv_progress_style;

/* Units "bytes" are shown as MiB; any other unit is shown as a count ("tokens", "steps"). */
typedef struct rekv_progress {
    FILE *out;
    rekv_progress_style style;
    char what[48];     /* leads every line, e.g. "rekv eval" */
    char unit[16];     /* after the counts */
    char note[96];     /* after the percentage: the latest note given to update */
    uint64_t total;    /* 0: unknown */
    uint64_t done;     /* as of the last update */
    int tenth;         /* LINES: the last tenth written (0: none yet) */
    uint64_t shown_ns; /* when the last line or bar was written (0: never) */
    uint64_t start_ns; /* when begin was called */
    uint64_t delay_ns; /* nothing is written before start_ns + delay_ns */
} rekv_progress;

/* The style for out: QUIET when quiet, BAR when out is a terminal, else LINES. */
rekv_progress_style rekv_progress_style_for(FILE *out, int quiet);

/* Starts reporting work of total units (0: unknown) on out in style (QUIET when $REKV_PROGRESS is
 * 0; no delay when it is 1); writes nothing yet. */
void rekv_progress_begin(rekv_progress *p, FILE *out, rekv_progress_style style, const char *what,
                         const char *unit, uint64_t total);

/* done units of the work are done (a count that only grows); note (may be NULL: keep the last
 * one) is shown after the percentage, e.g. "nll 3.21". */
void rekv_progress_update(rekv_progress *p, uint64_t done, const char *note);

/* The work is over: a bar is drawn a last time and its line ended; an unknown total gets a last
 * line with the count. Safe to call more than once. */
void rekv_progress_end(rekv_progress *p);

/* A rekv_progress_fn: arg is a rekv_progress; a total given here replaces the one it began with. */
void rekv_progress_cb(void *arg, uint64_t done, uint64_t total);

#endif
