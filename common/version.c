/* version.c — rekv_version(); the only file the build's git describe reaches, so that a new
 * commit recompiles one file (the Makefile rebuilds it when the describe changes). */
#include "common/version.h"

#ifndef REKV_GIT_DESCRIBE
#define REKV_GIT_DESCRIBE ""
#endif

const char *rekv_version(void)
{
    return REKV_GIT_DESCRIBE[0] ? REKV_VERSION " (git " REKV_GIT_DESCRIBE ")" : REKV_VERSION;
}
