// llama-mtp's extern "C" shim; see shim.h for what each piece is for.
#include "shim.h"

#include "llama-ext.h"   // C++-only upstream header (src/), not installed by llama.cpp
#include "llama-hparams.h"  // LLAMA_MAX_LAYERS
#include "llama-model.h"    // the LM head tensors (draft head)
#include "llama-impl.h"     // LLAMA_LOG_ERROR

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstring>
#include <string>
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

// --- draft head -------------------------------------------------------------

struct lmtp_head {
    const ggml_tensor *  src = nullptr;     // the model's head: {n_embd, n_vocab}
    ggml_context *       wctx = nullptr;    // owns w
    ggml_tensor *        w = nullptr;       // {n_embd, capacity}, src's type; rows [0, rows) filled
    int32_t              rows = 0;
    int32_t              capacity = 0;
    std::vector<uint8_t> scratch;           // one call's graph, input and output
    std::vector<uint8_t> work;              // its ggml work buffer (x in the weights' dot type)
};

struct lmtp_head * lmtp_head_new(const struct llama_model * model, int32_t capacity) {
    if (model == nullptr || capacity <= 0) {
        LLAMA_LOG_ERROR("%s: no model or capacity %d\n", __func__, (int) capacity);
        return nullptr;
    }
    const auto & hp = model->hparams;
    const ggml_tensor * head = nullptr;
    const ggml_tensor * scale = nullptr;
    if (hp.n_layer_nextn > 0) {
        const size_t il = hp.n_layer();  // the MTP block follows the trunk (graph_mtp)
        if (il < model->layers.size() && model->layers[il].nextn.shared_head_head) {
            head  = model->layers[il].nextn.shared_head_head;
            scale = model->layers[il].nextn.shared_head_head_s;
        }
    }
    if (head == nullptr) {
        head  = model->output;
        scale = model->output_s;
    }
    if (head == nullptr || head->buffer == nullptr) {
        LLAMA_LOG_ERROR("%s: the model has no LM head to draft with\n", __func__);
        return nullptr;
    }
    if (scale != nullptr) {
        LLAMA_LOG_ERROR("%s: the LM head has a scale tensor: not supported by the draft head\n", __func__);
        return nullptr;
    }
    const std::string buft = ggml_backend_buft_name(ggml_backend_buffer_get_type(head->buffer));
    if (buft.find("REPACK") != std::string::npos || buft.find("AMX") != std::string::npos ||
        buft.find("KLEIDI") != std::string::npos) {
        LLAMA_LOG_ERROR("%s: the LM head's weights are repacked for this CPU (%s): rows cannot be copied\n",
                        __func__, buft.c_str());
        return nullptr;
    }
    const int64_t n_vocab = head->ne[1];
    capacity = (int32_t) std::min<int64_t>(capacity, n_vocab);
    auto * h = new lmtp_head();
    h->src = head;
    h->capacity = capacity;
    ggml_init_params ip = { ggml_tensor_overhead() * 2 + ggml_row_size(head->type, head->ne[0]) * capacity + 256,
                            nullptr, false };
    h->wctx = ggml_init(ip);
    if (h->wctx == nullptr) {
        LLAMA_LOG_ERROR("%s: out of memory for %d rows\n", __func__, (int) capacity);
        delete h;
        return nullptr;
    }
    h->w = ggml_new_tensor_2d(h->wctx, head->type, head->ne[0], capacity);
    return h;
}

void lmtp_head_free(struct lmtp_head * head) {
    if (head == nullptr) return;
    if (head->wctx) ggml_free(head->wctx);
    delete head;
}

int32_t lmtp_head_rows(const struct lmtp_head * head) { return head ? head->rows : 0; }

int32_t lmtp_head_add(struct lmtp_head * head, const int32_t * ids, int32_t n) {
    if (head == nullptr || n < 0 || (n > 0 && ids == nullptr)) return -1;
    if (head->rows + n > head->capacity) {
        LLAMA_LOG_ERROR("%s: %d rows do not fit (%d of %d used)\n", __func__, (int) n, (int) head->rows,
                        (int) head->capacity);
        return -1;
    }
    const int64_t n_vocab = head->src->ne[1];
    for (int32_t i = 0; i < n; ++i) {
        if (ids[i] < 0 || ids[i] >= n_vocab) {
            LLAMA_LOG_ERROR("%s: token id %d out of range [0, %lld)\n", __func__, (int) ids[i], (long long) n_vocab);
            return -1;
        }
    }
    const size_t row = head->src->nb[1];
    for (int32_t i = 0; i < n; ++i) {
        // works for any backend buffer (host memcpy, or a copy back from a device)
        ggml_backend_tensor_get(head->src, (char *) head->w->data + (size_t) (head->rows + i) * head->w->nb[1],
                                (size_t) ids[i] * row, ggml_row_size(head->src->type, head->src->ne[0]));
    }
    head->rows += n;
    return head->rows;
}

int32_t lmtp_head_logits(struct lmtp_head * head, const float * x, int32_t n_x, float * out, int32_t n_threads) {
    if (head == nullptr || x == nullptr || out == nullptr || n_x <= 0 || head->rows <= 0) return -1;
    const int64_t n_embd = head->w->ne[0];
    // three tensors and a graph, x, the product, slack for alignment (the work buffer is apart)
    const size_t need = ggml_tensor_overhead() * 8 + ggml_graph_overhead() +
                        (size_t) n_embd * n_x * sizeof(float) + (size_t) head->rows * n_x * sizeof(float) + 4096;
    if (head->scratch.size() < need) head->scratch.resize(need);
    ggml_init_params ip = { head->scratch.size(), head->scratch.data(), false };
    ggml_context * ctx = ggml_init(ip);
    if (ctx == nullptr) return -1;
    ggml_tensor * w = ggml_view_2d(ctx, head->w, n_embd, head->rows, head->w->nb[1], 0);
    ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_embd, n_x);
    std::memcpy(xt->data, x, (size_t) n_embd * n_x * sizeof(float));
    ggml_tensor * y = ggml_mul_mat(ctx, w, xt);  // {rows, n_x}
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_cplan plan = ggml_graph_plan(gf, std::max(1, (int) n_threads), nullptr);
    if (plan.work_size > 0) {
        if (head->work.size() < plan.work_size) head->work.resize(plan.work_size);
        plan.work_data = head->work.data();
    }
    const ggml_status st = ggml_graph_compute(gf, &plan);
    if (st == GGML_STATUS_SUCCESS) {
        std::memcpy(out, y->data, (size_t) head->rows * n_x * sizeof(float));
    } else {
        LLAMA_LOG_ERROR("%s: ggml compute failed (%d)\n", __func__, (int) st);
    }
    ggml_free(ctx);
    return st == GGML_STATUS_SUCCESS ? 0 : -1;
}

}  // extern "C"
