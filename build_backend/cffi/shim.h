/* llama-mtp's extern "C" shim: the few things llama.h does not offer.
 *
 * - the MTP hooks upstream keeps C++-only in src/llama-ext.h (mangled names);
 * - version constants, so a stale binary is caught at import;
 * - an abort callback fed by a per-context flag and by SIGINT, so Ctrl-C stops
 *   a long decode and the context stays usable;
 * - a log filter in front of the Python log callback;
 * - a decode that, when aborted or failed half-way, puts every sequence it
 *   touched back where it was (or removes it entirely), in the same C call;
 * - a draft head: a copy of some rows of the LM head the MTP block drafts with,
 *   multiplied on the CPU (a reduced draft vocabulary).
 */
#ifndef LLAMA_MTP_SHIM_H
#define LLAMA_MTP_SHIM_H

#include <stdbool.h>
#include <stdint.h>

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

const char * lmtp_version(void);
const char * lmtp_llama_commit(void);
int          lmtp_max_layers(void);  /* LLAMA_MAX_LAYERS (src/llama-hparams.h) */

/* llama-ext.h, re-exported with C linkage */
void    lmtp_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float * lmtp_get_embeddings_nextn(struct llama_context * ctx);
float * lmtp_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
void    lmtp_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);

/* interrupts: `state` is the abort_callback_data of a context */
struct lmtp_abort_state {
    int requested;   /* set (from any thread) to abort the running decode */
    int sig_base;    /* SIGINT count when the current decode started */
    int by_signal;   /* after lmtp_decode: 1 if a SIGINT arrived during it */
};
bool lmtp_abort_cb(void * state);
void lmtp_sigint_arm(void);

/* logging: forward llama.cpp/ggml log lines at >= min_level (CONT resolved) */
void lmtp_log_install(ggml_log_callback forward, int min_level);
void lmtp_log_set_min_level(int min_level);

/* llama_decode, then llama_synchronize (returns when a GPU has finished, not when the
 * graph is queued); on abort (2) or fatal error (< -1) every sequence of the batch
 * is rolled back to its pre-call pos_max when exact_rollback (attention-only
 * memory), else removed entirely (dropped[seq] = 1; n_seq_max entries). */
int32_t lmtp_decode(struct llama_context * ctx, struct llama_batch batch, bool exact_rollback,
                    struct lmtp_abort_state * state, int8_t * dropped);

/* Draft head: rows of the LM head the MTP block of `model` drafts with (its own
 * nextn.shared_head_head, else the model's output matrix), copied in the tensor's own
 * type into `capacity` slots on the CPU. NULL (and a logged reason) where that head
 * cannot be copied: no MTP block, a scaled head, weights repacked for this CPU. */
struct lmtp_head;
struct lmtp_head * lmtp_head_new(const struct llama_model * model, int32_t capacity);
void    lmtp_head_free(struct lmtp_head * head);
/* append the rows of token ids[0..n): the new row count, or -1 (out of range / full) */
int32_t lmtp_head_add(struct lmtp_head * head, const int32_t * ids, int32_t n);
int32_t lmtp_head_rows(const struct lmtp_head * head);
/* out[r * rows + j] = row j . x[r] for r < n_x (x: n_x rows of n_embd floats);
 * 0, or -1 on failure (logged) */
int32_t lmtp_head_logits(struct lmtp_head * head, const float * x, int32_t n_x, float * out, int32_t n_threads);

#ifdef __cplusplus
}
#endif

#endif
