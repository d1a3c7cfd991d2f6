/* Curated cffi declarations for llama_mtp.
 *
 * Spelled exactly as include/llama.h (and ggml's headers) spell them; the
 * compiler checks every line against the real headers (API mode). Structs are
 * partial ("...;"): the compiler supplies offsets, sizes and fields we do not
 * name. Constants are "...": their values come from the headers, never from
 * Python. Bind what the package uses; build_backend/check_header_drift.py lists
 * the rest of llama.h.
 */

/* ---- ggml ---------------------------------------------------------------- */

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE = ...,
    GGML_LOG_LEVEL_DEBUG = ...,
    GGML_LOG_LEVEL_INFO = ...,
    GGML_LOG_LEVEL_WARN = ...,
    GGML_LOG_LEVEL_ERROR = ...,
    GGML_LOG_LEVEL_CONT = ...,
    ...
};

enum ggml_type {
    GGML_TYPE_F32 = ...,
    GGML_TYPE_F16 = ...,
    GGML_TYPE_BF16 = ...,
    GGML_TYPE_Q8_0 = ...,
    GGML_TYPE_Q4_0 = ...,
    GGML_TYPE_COUNT = ...,
    ...
};

typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);

const char * ggml_type_name(enum ggml_type type);
size_t ggml_type_size(enum ggml_type type);
int64_t ggml_blck_size(enum ggml_type type);

typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;

enum ggml_backend_dev_type {
    GGML_BACKEND_DEVICE_TYPE_CPU = ...,
    GGML_BACKEND_DEVICE_TYPE_GPU = ...,
    GGML_BACKEND_DEVICE_TYPE_IGPU = ...,
    GGML_BACKEND_DEVICE_TYPE_ACCEL = ...,
    ...
};

size_t                     ggml_backend_reg_count(void);
ggml_backend_reg_t         ggml_backend_reg_get(size_t index);
const char *               ggml_backend_reg_name(ggml_backend_reg_t reg);
size_t                     ggml_backend_dev_count(void);
ggml_backend_dev_t         ggml_backend_dev_get(size_t index);
const char *               ggml_backend_dev_name(ggml_backend_dev_t device);
const char *               ggml_backend_dev_description(ggml_backend_dev_t device);
void                       ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
ggml_backend_reg_t         ggml_backend_dev_backend_reg(ggml_backend_dev_t device);

/* ---- llama: types -------------------------------------------------------- */

#define LLAMA_DEFAULT_SEED ...
#define LLAMA_TOKEN_NULL ...
#define LLAMA_STATE_SEQ_FLAGS_NONE ...
#define LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY ...
#define LLAMA_STATE_SEQ_FLAGS_ON_DEVICE ...

struct llama_vocab;
struct llama_model;
struct llama_context;

typedef struct llama_memory_i * llama_memory_t;

typedef int32_t llama_pos;
typedef int32_t llama_token;
typedef int32_t llama_seq_id;
typedef uint32_t llama_state_seq_flags;

enum llama_vocab_type {
    LLAMA_VOCAB_TYPE_NONE = ...,
    LLAMA_VOCAB_TYPE_SPM = ...,
    LLAMA_VOCAB_TYPE_BPE = ...,
    LLAMA_VOCAB_TYPE_WPM = ...,
    LLAMA_VOCAB_TYPE_UGM = ...,
    LLAMA_VOCAB_TYPE_RWKV = ...,
    LLAMA_VOCAB_TYPE_PLAMO2 = ...,
    LLAMA_VOCAB_TYPE_TEST = ...,
    ...
};

enum llama_rope_type {
    LLAMA_ROPE_TYPE_NONE = ...,
    LLAMA_ROPE_TYPE_NORM = ...,
    LLAMA_ROPE_TYPE_NEOX = ...,
    LLAMA_ROPE_TYPE_MROPE = ...,
    LLAMA_ROPE_TYPE_IMROPE = ...,
    LLAMA_ROPE_TYPE_VISION = ...,
    ...
};

enum llama_split_mode {
    LLAMA_SPLIT_MODE_NONE = ...,
    LLAMA_SPLIT_MODE_LAYER = ...,
    LLAMA_SPLIT_MODE_ROW = ...,
    ...
};

enum llama_load_mode {
    LLAMA_LOAD_MODE_AUTO = ...,
    LLAMA_LOAD_MODE_NONE = ...,
    LLAMA_LOAD_MODE_MMAP = ...,
    LLAMA_LOAD_MODE_MLOCK = ...,
    LLAMA_LOAD_MODE_MMAP_MLOCK = ...,
    ...
};

enum llama_context_type {
    LLAMA_CONTEXT_TYPE_DEFAULT = ...,
    LLAMA_CONTEXT_TYPE_MTP = ...,
    ...
};

enum llama_flash_attn_type {
    LLAMA_FLASH_ATTN_TYPE_AUTO = ...,
    LLAMA_FLASH_ATTN_TYPE_DISABLED = ...,
    LLAMA_FLASH_ATTN_TYPE_ENABLED = ...,
    ...
};

enum llama_pooling_type {
    LLAMA_POOLING_TYPE_UNSPECIFIED = ...,
    LLAMA_POOLING_TYPE_NONE = ...,
    ...
};

typedef bool (*llama_progress_callback)(float progress, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;

    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_model_params {
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    enum llama_load_mode load_mode;
    int32_t main_gpu;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    bool vocab_only;
    bool check_tensors;
    bool load_mtp;
    ...;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    uint32_t n_rs_seq;
    uint32_t n_outputs_max;
    uint32_t n_outputs_max_per_seq;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_context_type ctx_type;
    enum llama_pooling_type pooling_type;
    enum llama_flash_attn_type flash_attn_type;
    enum ggml_type type_k;
    enum ggml_type type_v;
    ggml_abort_callback abort_callback;
    void * abort_callback_data;
    bool embeddings;
    bool offload_kqv;
    bool no_perf;
    bool op_offload;
    bool swa_full;
    bool kv_unified;
    struct llama_context * ctx_other;
    ...;
};

typedef struct llama_chat_message {
    const char * role;
    const char * content;
} llama_chat_message;

struct llama_perf_context_data {
    double t_start_ms;
    double t_load_ms;
    double t_p_eval_ms;
    double t_eval_ms;
    int32_t n_p_eval;
    int32_t n_eval;
    int32_t n_reused;
    ...;
};

/* ---- llama: functions ---------------------------------------------------- */

struct llama_model_params   llama_model_default_params(void);
struct llama_context_params llama_context_default_params(void);

void llama_backend_init(void);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);

struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

int64_t llama_time_us(void);
size_t  llama_max_devices(void);
size_t  llama_max_parallel_sequences(void);
bool    llama_supports_mmap(void);
bool    llama_supports_mlock(void);
bool    llama_supports_gpu_offload(void);
bool    llama_supports_rpc(void);
const char * llama_print_system_info(void);
const char * llama_flash_attn_type_name(enum llama_flash_attn_type flash_attn_type);

uint32_t llama_n_ctx(const struct llama_context * ctx);
uint32_t llama_n_ctx_seq(const struct llama_context * ctx);
uint32_t llama_n_batch(const struct llama_context * ctx);
uint32_t llama_n_ubatch(const struct llama_context * ctx);
uint32_t llama_n_seq_max(const struct llama_context * ctx);
uint32_t llama_n_rs_seq(const struct llama_context * ctx);

llama_memory_t llama_get_memory(const struct llama_context * ctx);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);

int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd(const struct llama_model * model);
int32_t llama_model_n_embd_inp(const struct llama_model * model);
int32_t llama_model_n_embd_out(const struct llama_model * model);
int32_t llama_model_n_layer(const struct llama_model * model);
int32_t llama_model_n_layer_nextn(const struct llama_model * model);
enum llama_rope_type llama_model_rope_type(const struct llama_model * model);
int32_t llama_model_n_head(const struct llama_model * model);
int32_t llama_model_n_head_kv(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);
int32_t llama_model_meta_count(const struct llama_model * model);
int32_t llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
const char * llama_model_chat_template(const struct llama_model * model, const char * name);
bool llama_model_has_encoder(const struct llama_model * model);
bool llama_model_is_recurrent(const struct llama_model * model);
bool llama_model_is_hybrid(const struct llama_model * model);

enum llama_vocab_type llama_vocab_type(const struct llama_vocab * vocab);
int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
const char * llama_vocab_get_text(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
bool llama_vocab_is_control(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
llama_token llama_vocab_eot(const struct llama_vocab * vocab);
llama_token llama_vocab_nl(const struct llama_vocab * vocab);
llama_token llama_vocab_pad(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_eos(const struct llama_vocab * vocab);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
                             int32_t length, int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);
int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
                                  bool add_ass, char * buf, int32_t length);

void llama_memory_clear(llama_memory_t mem, bool data);
bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1);
void llama_memory_seq_keep(llama_memory_t mem, llama_seq_id seq_id);
void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
bool llama_memory_can_shift(llama_memory_t mem);

size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size,
                                    llama_seq_id seq_id, llama_state_seq_flags flags);
size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src, size_t size,
                                    llama_seq_id dest_seq_id, llama_state_seq_flags flags);

void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
int32_t llama_n_threads(struct llama_context * ctx);
int32_t llama_n_threads_batch(struct llama_context * ctx);
void llama_synchronize(struct llama_context * ctx);

float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

struct llama_perf_context_data llama_perf_context(const struct llama_context * ctx);
void llama_perf_context_reset(struct llama_context * ctx);

/* ---- the shim (shim.h) ---------------------------------------------------- */

const char * lmtp_version(void);
const char * lmtp_llama_commit(void);
int          lmtp_max_layers(void);  /* LLAMA_MAX_LAYERS (src/llama-hparams.h) */

void    lmtp_set_embeddings_nextn(struct llama_context * ctx, bool value, bool masked);
float * lmtp_get_embeddings_nextn(struct llama_context * ctx);
float * lmtp_get_embeddings_nextn_ith(struct llama_context * ctx, int32_t i);
void    lmtp_set_nextn_layer_offset(struct llama_context * ctx, int32_t offset);

struct lmtp_abort_state {
    int requested;
    int sig_base;
    int by_signal;
};
bool lmtp_abort_cb(void * state);
void lmtp_sigint_arm(void);

void lmtp_log_install(ggml_log_callback forward, int min_level);
void lmtp_log_set_min_level(int min_level);

int32_t lmtp_decode(struct llama_context * ctx, struct llama_batch batch, bool exact_rollback,
                    struct lmtp_abort_state * state, int8_t * dropped);

struct lmtp_head;
struct lmtp_head * lmtp_head_new(const struct llama_model * model, int32_t capacity);
void    lmtp_head_free(struct lmtp_head * head);
int32_t lmtp_head_add(struct lmtp_head * head, const int32_t * ids, int32_t n);
int32_t lmtp_head_rows(const struct lmtp_head * head);
int32_t lmtp_head_logits(struct lmtp_head * head, const float * x, int32_t n_x, float * out, int32_t n_threads);

/* ---- callbacks into Python ------------------------------------------------ */

extern "Python" void _lmtp_on_log(enum ggml_log_level level, const char * text, void * user_data);
extern "Python" bool _lmtp_on_progress(float progress, void * user_data);
