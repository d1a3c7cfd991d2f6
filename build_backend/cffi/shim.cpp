// llama-mtp's extern "C" shim; see shim.h for what each piece is for.
#include "shim.h"

#include "llama-ext.h"   // C++-only upstream header (src/), not installed by llama.cpp
#include "llama-hparams.h"  // LLAMA_MAX_LAYERS

#include <atomic>
#include <csignal>
#include <vector>

#ifndef LMTP_VERSION
#define LMTP_VERSION "0+unknown"
#endif
#ifndef LMTP_LLAMA_COMMIT
#define LMTP_LLAMA_COMMIT "unknown"
#endif

extern "C" {

const char * lmtp_version(void)      { return LMTP_VERSION; }
const char * lmtp_llama_commit(void) { return LMTP_LLAMA_COMMIT; }
int          lmtp_max_layers(void)   { return LLAMA_MAX_LAYERS; }

// --- llama-ext.h ----------------------------------------------------------

void lmtp_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked) {
    llama_set_embeddings_nextn(ctx, value, masked);
}

float * lmtp_get_embeddings_nextn(struct llama_context * ctx) {
    return llama_get_embeddings_nextn(ctx);
}

float * lmtp_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i) {
    return llama_get_embeddings_nextn_ith(ctx, i);
}

void lmtp_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset) {
    llama_set_nextn_layer_offset(ctx, offset);
}

// --- interrupts -------------------------------------------------------------

static std::atomic<int> g_sigint_count{0};
static std::atomic<int> g_decoding{0};  // decodes running now (any thread)

bool lmtp_abort_cb(void * data) {
    auto * st = static_cast<lmtp_abort_state *>(data);
    if (st == nullptr) {
        return false;
    }
    return reinterpret_cast<volatile int &>(st->requested) != 0 ||
           g_sigint_count.load(std::memory_order_relaxed) != st->sig_base;
}

#if defined(_WIN32)
void lmtp_sigint_arm(void) {}  // Ctrl-C is seen once the decode returns
#else
static struct sigaction g_prev_sigint;

static void lmtp_on_sigint(int sig, siginfo_t * info, void * uctx) {
    g_sigint_count.fetch_add(1, std::memory_order_relaxed);
    if (g_decoding.load(std::memory_order_relaxed) > 0) {
        // abort the running decode(s) only; Python re-raises the signal once the
        // decode has returned and memory is consistent (signal.raise_signal), so
        // its handler never fires inside a log callback half-way through
        return;
    }
    // not decoding: whatever was installed before us (normally Python's handler)
    if (g_prev_sigint.sa_flags & SA_SIGINFO) {
        if (g_prev_sigint.sa_sigaction) g_prev_sigint.sa_sigaction(sig, info, uctx);
    } else if (g_prev_sigint.sa_handler != SIG_DFL && g_prev_sigint.sa_handler != SIG_IGN) {
        g_prev_sigint.sa_handler(sig);
    }
}

void lmtp_sigint_arm(void) {
    struct sigaction cur;
    if (sigaction(SIGINT, nullptr, &cur) != 0) return;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == lmtp_on_sigint) return;  // armed
    if (!(cur.sa_flags & SA_SIGINFO) && (cur.sa_handler == SIG_DFL || cur.sa_handler == SIG_IGN)) {
        return;  // the user chose default/ignore: leave it alone
    }
    g_prev_sigint = cur;
    struct sigaction sa = {};
    sa.sa_sigaction = lmtp_on_sigint;
    sa.sa_flags = SA_SIGINFO | (cur.sa_flags & SA_ONSTACK);
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
}
#endif

// --- logging ----------------------------------------------------------------

static ggml_log_callback g_log_forward = nullptr;
static std::atomic<int>  g_log_min{GGML_LOG_LEVEL_WARN};
static thread_local int  g_log_last = GGML_LOG_LEVEL_INFO;

static void lmtp_on_log(enum ggml_log_level level, const char * text, void * user_data) {
    const int eff = level == GGML_LOG_LEVEL_CONT ? g_log_last : (int) level;
    g_log_last = eff;
    if (g_log_forward != nullptr && eff >= g_log_min.load(std::memory_order_relaxed)) {
        g_log_forward((enum ggml_log_level) eff, text, user_data);
    }
}

void lmtp_log_install(ggml_log_callback forward, int min_level) {
    g_log_forward = forward;
    g_log_min.store(min_level);
    llama_log_set(lmtp_on_log, nullptr);
}

void lmtp_log_set_min_level(int min_level) { g_log_min.store(min_level); }

// --- decode -----------------------------------------------------------------

int32_t lmtp_decode(struct llama_context * ctx, struct llama_batch batch, bool exact_rollback,
                    struct lmtp_abort_state * state, int8_t * dropped) {
    const int n_seq = (int) llama_n_seq_max(ctx);
    llama_memory_t mem = llama_get_memory(ctx);

    std::vector<llama_pos> before(n_seq, INT32_MIN);  // INT32_MIN: not in this batch
    for (int32_t i = 0; i < batch.n_tokens; ++i) {
        const int n_ids = batch.n_seq_id ? batch.n_seq_id[i] : 1;
        for (int k = 0; k < n_ids; ++k) {
            const llama_seq_id s = batch.seq_id ? batch.seq_id[i][k] : 0;
            if (s >= 0 && s < n_seq && before[s] == INT32_MIN) {
                before[s] = llama_memory_seq_pos_max(mem, s);
            }
        }
    }
    if (state) {
        state->sig_base  = g_sigint_count.load();
        state->by_signal = 0;
    }

    g_decoding.fetch_add(1);
    const int32_t rc = llama_decode(ctx, batch);
    // llama_decode only queues the graph on a GPU (the wait comes with the first read of
    // an output): wait here, so a decode is over when it returns -- its time is its own
    // (the adaptive policy prices decodes by it), and Ctrl-C during the GPU's work is
    // still held back until memory is consistent. A no-op on the CPU.
    llama_synchronize(ctx);
    g_decoding.fetch_sub(1);

    if (state) {
        state->by_signal = g_sigint_count.load() != state->sig_base;
    }
    if (rc == 2 || rc < -1) {
        // Processed ubatches stay in memory, and an aborted graph may have half
        // written a recurrent state in place: attention-only memory is trimmed
        // back exactly, recurrent/hybrid sequences are removed entirely.
        for (int s = 0; s < n_seq; ++s) {
            if (before[s] == INT32_MIN) continue;
            if (exact_rollback) {
                if (llama_memory_seq_pos_max(mem, s) == before[s]) continue;
                if (llama_memory_seq_rm(mem, s, before[s] + 1, -1)) continue;
            }
            llama_memory_seq_rm(mem, s, -1, -1);
            if (dropped) dropped[s] = 1;
        }
    }
    return rc;
}

}  // extern "C"
