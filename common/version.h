/* version.h — the one version every rekv program prints for --version. */
#ifndef REKV_COMMON_VERSION_H
#define REKV_COMMON_VERSION_H

/* The release. A build from a git checkout adds `git describe` of its tree (the Makefile passes
 * it to common/version.c only, as REKV_GIT_DESCRIBE). */
#define REKV_VERSION "0.1.0"

/* "0.1.0 (git f4154cd-dirty)" from a git checkout, "0.1.0" elsewhere. Static storage. */
const char *rekv_version(void);

#endif
