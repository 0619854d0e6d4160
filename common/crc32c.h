/* crc32c.h — CRC32C (Castagnoli), for what the store spills and the coordinator journals. */
#ifndef REKV_COMMON_CRC32C_H
#define REKV_COMMON_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* CRC32C (Castagnoli), as iSCSI/ext4 use it: crc = rekv_crc32c(0, buf, n) for a whole buffer,
 * chainable by passing the previous value. SSE4.2 when the CPU has it, a table otherwise. */
uint32_t rekv_crc32c(uint32_t crc, const void *buf, size_t n);

#endif
