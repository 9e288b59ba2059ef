/*
 * The subset of QEMU's TCG plugin API (API version 7, QEMU 11.1.x) that kph_plugin.c
 * uses, declared by kprobe-harness itself: Debian ships no qemu-plugin.h.
 *
 * Written from the API's documentation (docs/devel/tcg-plugins.rst of QEMU 11.1) and
 * checked against the symbols `nm -D` shows in the QEMU 11.1.3 binary the harness runs.
 * In API 7 every callback takes a trailing `void *userdata` and none takes the plugin id.
 *
 * The glib types the API passes are declared here too, as far as they are used (their
 * public fields only): the plugin is loaded into QEMU, which has glib loaded already, so
 * it links against nothing and builds without libglib2.0-dev.
 */
#ifndef KPH_QEMU_PLUGIN_H
#define KPH_QEMU_PLUGIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KPH_EXPORT __attribute__((visibility("default")))
#define KPH_QEMU_PLUGIN_API 7

/* ---- glib: public structure fields and the few functions used ---- */
typedef struct { char *data; unsigned int len; } GArray;
typedef struct { uint8_t *data; unsigned int len; } GByteArray;
GByteArray *g_byte_array_new(void);
GByteArray *g_byte_array_set_size(GByteArray *array, unsigned int length);
uint8_t *g_byte_array_free(GByteArray *array, int free_segment);
char *g_array_free(GArray *array, int free_segment);
unsigned int g_array_get_element_size(GArray *array);

/* ---- QEMU plugin API 7 ---- */
typedef uint64_t qemu_plugin_id_t;

typedef struct qemu_info_t {
    const char *target_name;
    struct { int min; int cur; } version;
    bool system_emulation;
    union {
        struct { int smp_vcpus; int max_vcpus; } system;
    };
} qemu_info_t;

struct qemu_plugin_tb;
struct qemu_plugin_insn;
struct qemu_plugin_register;

/* qemu_plugin_get_registers() returns an array of these; the element is larger than
 * these three fields in 11.1.3 (32 bytes), so walk it with g_array_get_element_size(). */
typedef struct {
    struct qemu_plugin_register *handle;
    const char *name;
    const char *feature;
} qemu_plugin_reg_descriptor;

enum qemu_plugin_cb_flags {
    QEMU_PLUGIN_CB_NO_REGS,
    QEMU_PLUGIN_CB_R_REGS,
    QEMU_PLUGIN_CB_RW_REGS,
    QEMU_PLUGIN_CB_RW_REGS_PC,   /* needed by qemu_plugin_set_pc() */
};

enum qemu_plugin_discon_type {
    QEMU_PLUGIN_DISCON_INTERRUPT = 1,
    QEMU_PLUGIN_DISCON_EXCEPTION = 2,
    QEMU_PLUGIN_DISCON_HOSTCALL = 4,
    QEMU_PLUGIN_DISCON_ALL = -1,
};

typedef void (*qemu_plugin_udata_cb_t)(void *userdata);
typedef void (*qemu_plugin_vcpu_udata_cb_t)(unsigned int vcpu_index, void *userdata);
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(struct qemu_plugin_tb *tb, void *userdata);
typedef void (*qemu_plugin_vcpu_discon_cb_t)(unsigned int vcpu_index,
                                             enum qemu_plugin_discon_type type,
                                             uint64_t from_pc, uint64_t to_pc,
                                             void *userdata);

void qemu_plugin_register_vcpu_init_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_udata_cb_t cb,
                                       void *userdata);
void qemu_plugin_register_vcpu_idle_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_udata_cb_t cb,
                                       void *userdata);
void qemu_plugin_register_vcpu_resume_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_udata_cb_t cb,
                                         void *userdata);
void qemu_plugin_register_vcpu_discon_cb(qemu_plugin_id_t id, enum qemu_plugin_discon_type type,
                                         qemu_plugin_vcpu_discon_cb_t cb, void *userdata);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb,
                                           void *userdata);
void qemu_plugin_register_vcpu_tb_exec_cb(struct qemu_plugin_tb *tb, qemu_plugin_vcpu_udata_cb_t cb,
                                          enum qemu_plugin_cb_flags flags, void *userdata);
void qemu_plugin_register_vcpu_insn_exec_cb(struct qemu_plugin_insn *insn,
                                            qemu_plugin_vcpu_udata_cb_t cb,
                                            enum qemu_plugin_cb_flags flags, void *userdata);
/* Scoreboards: per-vCPU values that inline conditions read (conditional callbacks). */
struct qemu_plugin_scoreboard;
typedef struct {
    struct qemu_plugin_scoreboard *score;
    size_t offset;
} qemu_plugin_u64;
enum qemu_plugin_cond {
    QEMU_PLUGIN_COND_NEVER, QEMU_PLUGIN_COND_ALWAYS, QEMU_PLUGIN_COND_EQ, QEMU_PLUGIN_COND_NE,
    QEMU_PLUGIN_COND_LT, QEMU_PLUGIN_COND_LE, QEMU_PLUGIN_COND_GT, QEMU_PLUGIN_COND_GE,
};
struct qemu_plugin_scoreboard *qemu_plugin_scoreboard_new(size_t element_size);
void qemu_plugin_u64_set(qemu_plugin_u64 entry, unsigned int vcpu_index, uint64_t val);
void qemu_plugin_register_vcpu_tb_exec_cond_cb(struct qemu_plugin_tb *tb,
                                               qemu_plugin_vcpu_udata_cb_t cb,
                                               enum qemu_plugin_cb_flags flags,
                                               enum qemu_plugin_cond cond,
                                               qemu_plugin_u64 entry, uint64_t imm,
                                               void *userdata);

void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
void qemu_plugin_reset(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);

size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
uint64_t qemu_plugin_tb_vaddr(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
uint64_t qemu_plugin_insn_vaddr(const struct qemu_plugin_insn *insn);
size_t qemu_plugin_insn_size(const struct qemu_plugin_insn *insn);

GArray *qemu_plugin_get_registers(void);
bool qemu_plugin_read_register(struct qemu_plugin_register *handle, GByteArray *buf);
bool qemu_plugin_write_register(struct qemu_plugin_register *handle, GByteArray *buf);
void qemu_plugin_set_pc(uint64_t vaddr) __attribute__((noreturn));
bool qemu_plugin_read_memory_vaddr(uint64_t addr, GByteArray *data, size_t len);
bool qemu_plugin_translate_vaddr(uint64_t vaddr, uint64_t *hwaddr);
bool qemu_plugin_write_memory_vaddr(uint64_t addr, GByteArray *data);

void qemu_plugin_outs(const char *string);

#endif
