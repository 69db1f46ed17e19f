# Little-endian 32-bit fields of the TCP fabric's frame headers, shared by the compiled reader
# (_small.pyx) and sender (_gather.pyx); inline, nothing to link.
from libc.stdint cimport uint8_t, uint32_t


cdef inline uint32_t u32(const char* p) noexcept nogil:
    cdef const uint8_t* b = <const uint8_t*>p
    return b[0] | (<uint32_t>b[1] << 8) | (<uint32_t>b[2] << 16) | (<uint32_t>b[3] << 24)


cdef inline void put32(char* p, uint32_t v) noexcept nogil:
    cdef uint8_t* b = <uint8_t*>p
    b[0] = v & 0xFF
    b[1] = (v >> 8) & 0xFF
    b[2] = (v >> 16) & 0xFF
    b[3] = (v >> 24) & 0xFF
