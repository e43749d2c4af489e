/* test_conversation — the token stream of a session is exactly the chat template's tokens of the
** whole conversation, whatever order messages arrive in (two user messages in a row, a system
** message after a user turn, an edited history given to kvt_session_sync), and sessions sharing
** one engine do not change each other's numbers.  Tiny generated model, F32 KV cache, budget
** as large as the context (no eviction): the reference is the same tokens decoded directly. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "kvtier.h"
#include "kvtier_int.h" /* what the library shares internally: the tests call it too */
#include "test_hooks.h"
#include "fault.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kvt_engine *open_tiny(int32_t n_seq) {
    const char *dir = getenv("KVT_TINY_DIR");
    assert_non_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny-llama.gguf", dir);
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 1024 * n_seq; /* a stream of 1024 cells per sequence: sessions of budget 1024 */
    p.n_seq = n_seq;
    p.n_threads = 2;
    p.type_k = "f32";
    p.type_v = "f32";
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    return e;
}

static kvt_session *open_session(kvt_engine *e, int32_t seq, int32_t policy) {
    struct kvt_session_params sp = kvt_session_default_params();
    sp.seq = seq;
    sp.budget = 1024;
    sp.policy = policy;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    return s;
}

static const char *answer = "the cat sat on the mat";

/* Log-probability of `answer` after msgs formatted with the assistant prefix, decoded directly into
** sequence seq (which is left empty again). */
static double ref_logprob_text(kvt_engine *e, int32_t seq, const char *fmt) {
    kvt_token *t = NULL, *a = NULL;
    int32_t n = 0, na = 0;
    assert_int_equal(kvt_tokenize(e, fmt, true, true, &t, &n), 0);
    assert_int_equal(kvt_tokenize(e, answer, false, false, &a, &na), 0);
    assert_int_equal(kvt_engine_decode(e, seq, t, n, 0, true), 0);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    double lp = 0;
    for (int32_t i = 0; i < na; i++) {
        const float *l = kvt_engine_logits(e);
        double mx = -INFINITY, z = 0;
        for (int32_t v = 0; v < I.n_vocab; v++) mx = fmax(mx, l[v]);
        for (int32_t v = 0; v < I.n_vocab; v++) z += exp(l[v] - mx);
        lp += l[a[i]] - mx - log(z);
        if (i + 1 < na) assert_int_equal(kvt_engine_decode(e, seq, &a[i], 1, n + i, true), 0);
    }
    kvt_seq_rm(e, seq, -1, -1);
    free(t);
    free(a);
    return lp;
}

static double ref_logprob(kvt_engine *e, int32_t seq, const struct kvt_chat_msg *m, int32_t n) {
    char *fmt = NULL;
    assert_int_equal(kvt_chat_format(e, m, n, true, "gemma", &fmt), 0);
    double lp = ref_logprob_text(e, seq, fmt);
    free(fmt);
    return lp;
}

static double session_logprob(kvt_session *s) {
    double lp = 0;
    int32_t n = 0;
    assert_int_equal(kvt_session_answer_logprob(s, answer, &lp, &n), 0);
    assert_true(n > 0);
    return lp;
}

static int32_t ref_tokens(kvt_engine *e, const struct kvt_chat_msg *m, int32_t n) {
    char *fmt = NULL;
    kvt_token *t = NULL;
    int32_t nt = 0;
    assert_int_equal(kvt_chat_format(e, m, n, true, "gemma", &fmt), 0);
    assert_int_equal(kvt_tokenize(e, fmt, true, true, &t, &nt), 0);
    free(fmt);
    free(t);
    return nt;
}

static const struct kvt_chat_msg conv[] = {
    { "user", "the dog ran to the park and the cat sat on the wall" },
    { "user", "what did the cat do" },
};

#define TOL 1e-4 /* F32 cache, same cells: only summation order may differ (observed 0) */

static void test_two_user_messages(void **state) {
    (void) state;
    kvt_engine *e = open_tiny(2);
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, conv[0].content, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, conv[1].content, KVT_KEEP_NONE), 0);
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_int_equal(st.total_tokens, ref_tokens(e, conv, 2));
    double got = session_logprob(s);
    kvt_session_free(s);
    double want = ref_logprob(e, 1, conv, 2);
    printf("two user messages: session %.6f, template %.6f\n", got, want);
    assert_true(fabs(got - want) < TOL);
    /* control: the old behaviour (assistant prefix left between the two messages) is far off */
    char *f1 = NULL, *f2 = NULL;
    assert_int_equal(kvt_chat_format(e, conv, 1, true, "gemma", &f1), 0);
    assert_int_equal(kvt_chat_format(e, conv, 2, true, "gemma", &f2), 0);
    size_t c = 0;
    while (f1[c] && f1[c] == f2[c]) c++;
    char *bad = malloc(strlen(f1) + strlen(f2) + 1);
    strcpy(bad, f1);
    strcat(bad, f2 + c);
    double ctl = ref_logprob_text(e, 1, bad);
    printf("control (corrupted stream): %.6f\n", ctl);
    assert_true(fabs(ctl - want) > 100 * TOL);
    free(bad);
    free(f1);
    free(f2);
    kvt_engine_free(e);
}

static void test_system_after_user(void **state) {
    (void) state;
    kvt_engine *e = open_tiny(2);
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    const struct kvt_chat_msg m[] = { conv[0], { "system", "answer in one word" }, conv[1] };
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, m[0].content, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_SYSTEM, m[1].content, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, m[2].content, KVT_KEEP_NONE), 0);
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    assert_int_equal(st.total_tokens, ref_tokens(e, m, 3));
    double got = session_logprob(s);
    kvt_session_free(s);
    double want = ref_logprob(e, 1, m, 3);
    printf("system after user: session %.6f, template %.6f\n", got, want);
    assert_true(fabs(got - want) < TOL);
    kvt_engine_free(e);
}

/* sync: the echoed reply is reused (only the new tail is decoded); an edited reply and an edited
** first message are cut back to the divergence and match the template exactly again */
static void test_sync(void **state) {
    (void) state;
    kvt_engine *e = open_tiny(2);
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    struct kvt_sync_info si;
    assert_int_equal(kvt_session_sync(s, conv, 1, &si), 0);
    assert_int_equal(si.tokens_reused, 0);
    assert_int_equal(si.prompt_tokens, ref_tokens(e, conv, 1));
    struct kvt_sampling smp = { .temperature = 0, .top_p = 1 };
    int32_t n = 0;
    for (bool done = false; !done && n < 12; n++) {
        kvt_token t;
        assert_int_equal(kvt_session_gen_step(s, &smp, &t, &done), 0);
    }
    char *reply = NULL;
    assert_int_equal(kvt_session_gen_end(s, &reply), 0);
    assert_int_equal(kvt_session_n_messages(s), 2);
    struct kvt_chat_msg m[3] = { conv[0], { "assistant", reply }, conv[1] };
    int32_t before = si.prompt_tokens, n_reply = n - 1; /* the last step may have been end-of-turn */
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    n_reply = st.total_tokens - before;
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0);
    printf("turn 2: prompt %d, reused %d, decoded %lld (turn 1 prompt %d + reply %d)\n", si.prompt_tokens, si.tokens_reused,
           (long long) si.tokens_decoded, before, n_reply);
    /* the whole first turn and the generated reply's tokens stay (canonicalised: the template
    ** would tokenize the trimmed reply text differently); only the new tail is decoded */
    assert_int_equal(si.tokens_reused, before + n_reply);
    assert_int_equal(si.tokens_decoded, si.prompt_tokens - si.tokens_reused);
    double got, want;
    /* the client edits the reply */
    m[1].content = "it sat on the wall";
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0);
    assert_int_equal(si.prompt_tokens, ref_tokens(e, m, 3));
    got = session_logprob(s);
    want = ref_logprob(e, 1, m, 3);
    printf("edited reply: session %.6f, template %.6f, decoded %lld\n", got, want, (long long) si.tokens_decoded);
    assert_true(fabs(got - want) < TOL);
    /* the client edits its first message: everything is cut back */
    m[0].content = "a bird flew over the house";
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0);
    assert_int_equal(si.prompt_tokens, ref_tokens(e, m, 3));
    got = session_logprob(s);
    want = ref_logprob(e, 1, m, 3);
    printf("edited first message: session %.6f, template %.6f\n", got, want);
    assert_true(fabs(got - want) < TOL);
    /* the same request again: nothing to decode */
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0);
    assert_int_equal(si.tokens_decoded, 0);
    assert_true(fabs(session_logprob(s) - want) < TOL);
    /* bad input */
    const struct kvt_chat_msg bad_role[] = { { "robot", "hi" } };
    assert_int_equal(kvt_session_sync(s, bad_role, 1, NULL), KVT_EINVAL);
    const struct kvt_chat_msg last_ass[] = { conv[0], { "assistant", "x" } };
    assert_int_equal(kvt_session_sync(s, last_ass, 2, NULL), KVT_EINVAL);
    assert_int_equal(kvt_session_sync(s, m, 0, NULL), KVT_EINVAL);
    free(reply);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* Session B's numbers do not depend on what ran before it on the engine, nor on a session open
** beside it.  TOL_CONC: with another sequence's cells interleaved, the softmax and V sums run over
** a different cell layout (masked cells add exact zeros, but SIMD lanes group the terms
** differently): F32 rounding only, observed below 1e-5 nats. */
#define TOL_CONC 1e-3
static void run_b(kvt_session *b, double *lp) {
    const struct kvt_chat_msg m[] = { { "user", "the sun is hot and the moon is cold" } };
    assert_int_equal(kvt_session_sync(b, m, 1, NULL), 0);
    *lp = session_logprob(b);
}

static void run_a(kvt_session *a) {
    const struct kvt_chat_msg m[] = { { "user", "a long story about a dog that ran to the park every day" } };
    assert_int_equal(kvt_session_sync(a, m, 1, NULL), 0);
    struct kvt_sampling smp = { .temperature = 0.8f, .top_p = 0.9f, .seed = 7 };
    assert_int_equal(kvt_session_generate(a, 20, &smp, NULL, NULL, NULL), 0);
}

static void test_sessions_independent(void **state) {
    (void) state;
    double fresh, after, conc;
    kvt_engine *e = open_tiny(2);
    kvt_session *b = open_session(e, 0, KVT_POLICY_KVTIER);
    run_b(b, &fresh);
    kvt_session_free(b);
    kvt_engine_free(e);

    e = open_tiny(2);
    kvt_session *a = open_session(e, 0, KVT_POLICY_H2O); /* another policy: attention capture on */
    run_a(a);
    kvt_session_free(a);
    b = open_session(e, 0, KVT_POLICY_KVTIER);
    run_b(b, &after);
    kvt_session_free(b);
    printf("B fresh %.8f, after A %.8f (diff %.2e)\n", fresh, after, fabs(fresh - after));
    assert_true(fabs(fresh - after) < TOL);

    /* concurrently open: A on seq 0 and B on seq 1, interleaved call by call */
    a = open_session(e, 0, KVT_POLICY_KVTIER);
    b = open_session(e, 1, KVT_POLICY_KVTIER);
    const struct kvt_chat_msg ma[] = { { "user", "a long story about a dog that ran to the park every day" } };
    const struct kvt_chat_msg mb[] = { { "user", "the sun is hot and the moon is cold" } };
    assert_int_equal(kvt_session_sync(a, ma, 1, NULL), 0);
    assert_int_equal(kvt_session_sync(b, mb, 1, NULL), 0);
    struct kvt_sampling smp = { .temperature = 0, .top_p = 1 };
    for (int i = 0; i < 5; i++) { /* A decodes after B's prompt: B's logits must survive */
        kvt_token t;
        bool done;
        assert_int_equal(kvt_session_gen_step(a, &smp, &t, &done), 0);
        if (done) break;
    }
    conc = session_logprob(b);
    printf("B beside A: %.8f (diff %.2e)\n", conc, fabs(fresh - conc));
    assert_true(fabs(fresh - conc) < TOL_CONC);
    assert_int_equal(kvt_session_gen_end(a, NULL), 0);
    kvt_session_free(a);
    kvt_session_free(b);
    kvt_engine_free(e);
}


/* The same on Gemma 3 270M (Q4_K_M, F16 cache) with evictions (budget 256): session B after an
** H2O session A was opened, run and freed on the engine equals B on a fresh engine.  Beside an
** open session A (cells interleaved in the shared cache) B's numbers move: llama.cpp quantises
** activations (Q8_K) for the Q4_K matmuls, so the last-bit differences of a different summation
** order over the cells can flip a quantisation step and grow through the layers.  That is
** measured and printed, and bounded loosely; a session-private cell layout would need llama.cpp's
** non-unified cache, which the block primitives cannot use (partial seq_cp across streams). */
static const char *real_turns[] = {
    "Please remember this: the code word for the vault is saffron-kestrel. Now tell me about rivers.",
    "Can you explain how photosynthesis works in plants and why it matters for life on Earth?",
    "What were the main causes of the French Revolution, and how did it change Europe?",
    "Describe how a steam engine works and why it was important in the industrial revolution.",
    "What is the difference between a virus and a bacterium, and how do antibiotics work?",
    "How do volcanoes form, and what are the different types of volcanic eruptions?",
};
static const char *real_reply =
    "That is a good question. There is a lot to say about it, and I will keep my answer short and clear so that "
    "we can move on to the next topic in our long conversation about science and history.";

static kvt_engine *open_real(int32_t n_seq) {
    const char *m = getenv("KVTIER_MODEL");
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = m;
    p.n_ctx = 2048;
    p.n_seq = n_seq;
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    return e;
}

static kvt_session *open_real_session(kvt_engine *e, int32_t seq, int32_t policy) {
    struct kvt_session_params sp = kvt_session_default_params();
    sp.seq = seq;
    sp.budget = 256;
    sp.policy = policy;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    return s;
}

static void real_conv(kvt_session *s, int32_t n) {
    for (int32_t t = 0; t < n; t++) {
        assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, real_turns[t], KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, real_reply, KVT_KEEP_NONE), 0);
    }
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "What is the code word for the vault?", KVT_KEEP_NONE), 0);
}

static double real_lp(kvt_session *s) {
    double lp = 0;
    int32_t n = 0;
    assert_int_equal(kvt_session_answer_logprob(s, "The code word is saffron-kestrel.", &lp, &n), 0);
    return lp;
}

static void test_real_independent(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_MODEL");
    if (!m || !*m) {
        printf("skipped: KVTIER_MODEL not set\n");
        return;
    }
    kvt_engine *e = open_real(2);
    kvt_session *b = open_real_session(e, 0, KVT_POLICY_KVTIER);
    real_conv(b, 6);
    struct kvt_session_stats st;
    kvt_session_get_stats(b, &st);
    double fresh = real_lp(b);
    kvt_session_free(b);
    kvt_engine_free(e);

    e = open_real(2);
    kvt_session *a = open_real_session(e, 0, KVT_POLICY_H2O);
    real_conv(a, 4);
    struct kvt_sampling smp = { .temperature = 0.7f, .top_p = 0.9f, .seed = 3 };
    assert_int_equal(kvt_session_generate(a, 16, &smp, NULL, NULL, NULL), 0);
    kvt_session_free(a);
    b = open_real_session(e, 0, KVT_POLICY_KVTIER);
    real_conv(b, 6);
    double after = real_lp(b);
    kvt_session_free(b);
    printf("Gemma: B fresh %.6f (%lld evictions), B after A %.6f (diff %.2e)\n", fresh, (long long) st.evictions, after,
           fabs(after - fresh));
    assert_true(st.evictions > 0);
    assert_true(fabs(after - fresh) < 1e-4); /* same cells, same order: bit-identical in practice */

    a = open_real_session(e, 0, KVT_POLICY_H2O);
    b = open_real_session(e, 1, KVT_POLICY_KVTIER);
    for (int32_t t = 0; t < 6; t++) { /* interleaved turn by turn */
        if (t < 4) {
            assert_int_equal(kvt_session_add(a, KVT_ROLE_USER, real_turns[t], KVT_KEEP_NONE), 0);
            assert_int_equal(kvt_session_add(a, KVT_ROLE_ASSISTANT, real_reply, KVT_KEEP_NONE), 0);
        }
        assert_int_equal(kvt_session_add(b, KVT_ROLE_USER, real_turns[t], KVT_KEEP_NONE), 0);
        assert_int_equal(kvt_session_add(b, KVT_ROLE_ASSISTANT, real_reply, KVT_KEEP_NONE), 0);
    }
    assert_int_equal(kvt_session_add(b, KVT_ROLE_USER, "What is the code word for the vault?", KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(a, KVT_ROLE_USER, "And the steam engine?", KVT_KEEP_NONE), 0); /* A decodes last */
    double conc = real_lp(b);
    printf("Gemma: B beside A %.6f (diff %.2e nats)\n", conc, fabs(conc - fresh));
    assert_true(fabs(conc - fresh) < 1.0);
    kvt_session_free(a);
    kvt_session_free(b);
    kvt_engine_free(e);
}

/* The server's path on Gemma 3 at budget 256, as serve_test's planted fact runs it: every turn a
** step-wise prefill (kvt_session_prefill: the message's end and the assistant prefix in one
** chunk), one token drawn as the reply's last (struct kvt_gen_batch's last: not decoded), the
** reply ended, then the client's own scripted reply in the next request.  Recall of the code word
** by its teacher-forced log-probability (trajectory-free, unlike greedy text at near-ties), paired
** in the same run: a no-eviction reference (budget 2048) and a control whose first turn lacks the
** code word; the budget-256 session, which evicts, must sit nearer the reference.  Then the unfed token's text: after a reply
** whose last token was not decoded, the client sends the reply back and the session's stream
** reads exactly as the template's text of the conversation (and a short message and its prefix
** were one chunk).  Then a resend of the same conversation: nothing decoded, the same logits as
** the first time bit for bit; not after a park (the copy is dropped), not for another message. */
static void prefill_run(kvt_engine *e, kvt_session *s, const struct kvt_chat_msg *m, int32_t n, const kvt_token *tok,
                        int32_t n_tok);

static double server_path_conv(kvt_engine *e, int32_t seq, int32_t budget, bool with_fact, struct kvt_session_stats *st) {
    struct kvt_session_params sp = kvt_session_default_params();
    sp.seq = seq;
    sp.budget = budget;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    struct kvt_chat_msg m[16];
    int32_t n = 0;
    const struct kvt_sampling greedy = { 0 };
    for (int32_t t = 0; t < 6; t++) {
        m[n++] = (struct kvt_chat_msg){ "user", t == 0 && !with_fact ? "Now tell me about rivers." : real_turns[t] };
        prefill_run(e, s, m, n, NULL, 0);
        kvt_token tok;
        bool done = false, last = true;
        int st1 = 0;
        assert_int_equal(
            kvt_session_gen_step_batch(
                e,
                &(struct kvt_gen_batch){
                    .sessions = &s, .n = 1, .smp = &greedy, .tok = &tok, .done = &done, .status = &st1, .last = &last }),
            0);
        assert_int_equal(st1, 0);
        assert_null(kvt_session_logits(s)); /* the last draw leaves no logits to draw from */
        assert_int_equal(kvt_session_gen_end(s, NULL), 0);
        m[n++] = (struct kvt_chat_msg){ "assistant", real_reply };
    }
    m[n++] = (struct kvt_chat_msg){ "user", "What is the code word for the vault?" };
    prefill_run(e, s, m, n, NULL, 0);
    double lp = real_lp(s);
    kvt_session_get_stats(s, st);
    kvt_session_free(s);
    return lp;
}

/* The session's stream as text (every token's piece, special tokens as their text). */
static char *stream_text(kvt_engine *e, kvt_session *s) {
    const int32_t n = kvt_session_tokens(s, NULL, 0);
    kvt_token *t = malloc(sizeof(kvt_token) * (size_t) (n > 0 ? n : 1));
    assert_int_equal(kvt_session_tokens(s, t, n), n);
    char *txt = NULL;
    assert_int_equal(kvt_detokenize(e, t, n, true, &txt), 0);
    free(t);
    return txt;
}

static void test_server_path(void **state) {
    (void) state;
    const char *mp = getenv("KVTIER_MODEL");
    if (!mp || !*mp) {
        printf("skipped: KVTIER_MODEL not set\n");
        return;
    }
    kvt_engine *e = open_real(1);
    struct kvt_session_stats st, st_ref, st_ctrl;
    const double lp = server_path_conv(e, 0, 256, true, &st);
    const double lp_ref = server_path_conv(e, 0, 2048, true, &st_ref);
    const double lp_ctrl = server_path_conv(e, 0, 2048, false, &st_ctrl);
    printf("server path, Gemma: log P(code word) at budget 256 %.3f (%lld evictions, %lld recoveries), no eviction %.3f, "
           "without the code word %.3f\n",
           lp, (long long) st.evictions, (long long) st.recoveries, lp_ref, lp_ctrl);
    assert_true(st.evictions > 0); /* the policy kept the code word's block resident so far (recoveries: reported) */
    assert_int_equal(st_ref.evictions, 0);
    assert_true(lp_ref > lp_ctrl + 2); /* the reference knows it (else the pairing says nothing) */
    assert_true(lp - lp_ctrl >= 0.5 * (lp_ref - lp_ctrl));

    /* the unfed token's text comes in with the next turn */
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 2048;
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    struct kvt_chat_msg m[4] = { { "user", "Write a short sentence about the sea." } };
    /* the step-wise prefill hands out the short message and its assistant prefix as one chunk
    ** (one block holds both), with the logits */
    kvt_prefill *pf = NULL;
    struct kvt_decode_chunk c;
    int32_t n_chunks = 0;
    bool logits = false;
    assert_int_equal(kvt_session_prefill(s, m, 1, NULL, 0, &pf), 0);
    while (kvt_prefill_next(pf, 0, &c) == 1) {
        n_chunks++;
        logits = c.want_logits;
        assert_int_equal(kvt_prefill_done(pf, kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits)), 0);
    }
    assert_int_equal(kvt_prefill_end(pf, NULL), 0);
    assert_int_equal(n_chunks, 1);
    assert_true(logits);
    const int32_t n0 = kvt_session_tokens(s, NULL, 0);
    const struct kvt_sampling greedy = { 0 };
    kvt_token tok;
    bool done = false, no = false, yes = true;
    int st1 = 0;
    for (int32_t k = 0; k < 6 && !done; k++)
        assert_int_equal(kvt_session_gen_step_batch(e, &(struct kvt_gen_batch){ .sessions = &s,
                                                                                .n = 1,
                                                                                .smp = &greedy,
                                                                                .tok = &tok,
                                                                                .done = &done,
                                                                                .status = &st1,
                                                                                .last = k == 5 ? &yes : &no }),
                         0);
    const int32_t before = kvt_session_tokens(s, NULL, 0);
    char *reply = NULL;
    assert_int_equal(kvt_session_gen_end(s, &reply), 0);
    assert_false(done);
    assert_int_equal(before, n0 + 5); /* six drawn, the last not decoded */
    m[1] = (struct kvt_chat_msg){ "assistant", reply };
    m[2] = (struct kvt_chat_msg){ "user", "And one about the mountains." };
    prefill_run(e, s, m, 3, NULL, 0);
    char *got = stream_text(e, s), *fmt = NULL;
    assert_int_equal(kvt_chat_format(e, m, 3, true, sp.template_fallback, &fmt), 0);
    printf("reply %s (its last token not decoded: %d tokens before the next turn)\n", reply, before);
    /* the stream's text: the template's, the BOS aside (its piece may print as text) */
    const size_t lg = strlen(got), lf = strlen(fmt);
    if (!(lg >= lf && !strcmp(got + lg - lf, fmt))) printf("stream [%s]\ntemplate [%s]\n", got, fmt);
    assert_true(lg >= lf && !strcmp(got + lg - lf, fmt));
    free(got);
    free(fmt);

    /* the same conversation again after its reply: the prompt's logits back, nothing decoded */
    struct kvt_sync_info si;
    const float *l = kvt_session_logits(s);
    assert_non_null(l);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    float *l0 = malloc(sizeof(float) * (size_t) I.n_vocab);
    memcpy(l0, l, sizeof(float) * (size_t) I.n_vocab);
    const int32_t n_prompt = kvt_session_tokens(s, NULL, 0);
    for (int32_t k = 0; k < 4 && !done; k++)
        assert_int_equal(
            kvt_session_gen_step_batch(
                e, &(struct kvt_gen_batch){ .sessions = &s, .n = 1, .smp = &greedy, .tok = &tok, .done = &done, .status = &st1 }),
            0);
    assert_int_equal(kvt_session_gen_end(s, NULL), 0);
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0);
    assert_int_equal(si.tokens_decoded, 0);
    assert_int_equal(kvt_session_tokens(s, NULL, 0), n_prompt);
    assert_memory_equal(kvt_session_logits(s), l0, sizeof(float) * (size_t) I.n_vocab);
    /* controls: after a park the copy is gone (the prefix is decoded again); another last message
    ** is decoded */
    for (int32_t k = 0; k < 2; k++)
        assert_int_equal(
            kvt_session_gen_step_batch(
                e, &(struct kvt_gen_batch){ .sessions = &s, .n = 1, .smp = &greedy, .tok = &tok, .done = &done, .status = &st1 }),
            0);
    assert_int_equal(kvt_session_gen_end(s, NULL), 0);
    assert_int_equal(kvt_session_park(s), 0);
    assert_int_equal(kvt_session_resume(s, 0), 0);
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0);
    assert_true(si.tokens_decoded > 0);
    m[2].content = "And one about the rivers.";
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0);
    assert_true(si.tokens_decoded > 0);
    free(l0);
    free(reply);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* A prompt tokenized once (kvt_session_prefill's tok, as a server passes the tokens it chose the
** session by): on the tiny model, Gemma 3 and SmolLM2 (three templates, three tokenizers), session
** B given the request's tokens holds exactly the stream of session A, which tokenizes every part
** itself, turn after turn: a system document and a question, replies and more turns, an edited
** earlier message (the cut-back path), a resend, and user text that spells special tokens.  B
** took most of its tokens from the given ones (the one-tokenization path is the one tested).
** Control: B given the tokens of another conversation (its first message differs) uses none of
** them and still holds A's stream, and those tokens differ from A's, so using them would fail. */
static void prefill_run(kvt_engine *e, kvt_session *s, const struct kvt_chat_msg *m, int32_t n, const kvt_token *tok,
                        int32_t n_tok) {
    kvt_prefill *pf = NULL;
    struct kvt_decode_chunk c;
    assert_int_equal(kvt_session_prefill(s, m, n, tok, n_tok, &pf), 0);
    int r;
    while ((r = kvt_prefill_next(pf, 0, &c)) == 1)
        assert_int_equal(kvt_prefill_done(pf, kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits)), 0);
    assert_int_equal(r, 0);
    assert_int_equal(kvt_prefill_end(pf, NULL), 0);
}

static void assert_same_stream(kvt_session *a, kvt_session *b) {
    const int32_t na = kvt_session_tokens(a, NULL, 0), nb = kvt_session_tokens(b, NULL, 0);
    assert_int_equal(na, nb);
    kvt_token *ta = malloc(sizeof(kvt_token) * (size_t) na), *tb = malloc(sizeof(kvt_token) * (size_t) nb);
    assert_int_equal(kvt_session_tokens(a, ta, na), na);
    assert_int_equal(kvt_session_tokens(b, tb, nb), nb);
    assert_memory_equal(ta, tb, sizeof(kvt_token) * (size_t) na);
    free(ta);
    free(tb);
}

/* One turn: A tokenizes, B is given kvt_chat_tokenize's tokens of `given` (NULL: of m).  Returns
** the tokens B took from them. */
static int64_t turn_both(kvt_engine *e, kvt_session *a, kvt_session *b, const struct kvt_chat_msg *m, int32_t n,
                         const struct kvt_chat_msg *given, int32_t n_given, const char *fallback) {
    kvt_token *tok = NULL;
    int32_t n_tok = 0;
    assert_int_equal(kvt_chat_tokenize(e, given ? given : m, given ? n_given : n, true, fallback, &tok, &n_tok), 0);
    const int64_t used0 = kvt_session_test_given_tokens(b);
    prefill_run(e, a, m, n, NULL, 0);
    prefill_run(e, b, m, n, tok, n_tok);
    assert_same_stream(a, b);
    free(tok);
    return kvt_session_test_given_tokens(b) - used0;
}

/* Sessions on sequences 0 and 1, budget 2048, the template fallback given. */
static void open_pair(kvt_engine *e, const char *fallback, kvt_session *s[2]) {
    for (int32_t i = 0; i < 2; i++) {
        struct kvt_session_params sp = kvt_session_default_params();
        sp.seq = i;
        sp.budget = 2048;
        sp.template_fallback = fallback;
        assert_int_equal(kvt_session_open(e, &sp, &s[i]), 0);
    }
}

static void given_tokens_on(const char *path, const char *fallback, bool want_used) {
    struct kvt_engine_params p = kvt_engine_default_params();
    p.model_path = path;
    p.n_ctx = 2048 * 2;
    p.n_seq = 2;
    p.n_threads = 2;
    kvt_engine *e = NULL;
    assert_int_equal(kvt_engine_open(&p, &e), 0);
    kvt_session *s[2];
    open_pair(e, fallback, s);
    static const char doc[] =
        "The lighthouse keeper wrote every evening in a small blue notebook. He noted the wind, the colour of the sea "
        "and the ships that passed, and once a month he rowed to the village to buy oil, bread and tobacco. The notebook "
        "recorded storms that bent the iron railing, a whale that surfaced beside the rocks, and the winter the lamp "
        "failed for three nights. Visitors were rare; a painter came one summer and stayed until the first frost. ";
    char big[4 * sizeof doc];
    snprintf(big, sizeof big, "%s%s%s", doc, doc, doc);
    struct kvt_chat_msg m[8] = {
        { "system", big },
        { "user", "What did the keeper buy in the village?" },
        { "assistant", "Oil, bread and tobacco." },
        { "user", "And who stayed until the first frost? Answer in one word, not <end_of_turn> or <|im_end|>." },
        { "assistant", "A painter." },
        { "user", "Thanks. What failed for three nights?" },
    };
    int64_t used = 0, total = 0;
    used += turn_both(e, s[0], s[1], m, 2, NULL, 0, fallback);
    used += turn_both(e, s[0], s[1], m, 4, NULL, 0, fallback);
    used += turn_both(e, s[0], s[1], m, 6, NULL, 0, fallback);
    m[1].content = "What did the keeper write in?"; /* an edited history: both cut back */
    used += turn_both(e, s[0], s[1], m, 6, NULL, 0, fallback);
    used += turn_both(e, s[0], s[1], m, 6, NULL, 0, fallback); /* the same request again */
    total = kvt_session_tokens(s[1], NULL, 0);
    printf("%s: given tokens used %lld over the turns, stream %lld tokens\n", path, (long long) used, (long long) total);
    if (want_used) assert_true(used >= total / 2); /* the long first turn at least came from them */

    /* control: another conversation's tokens */
    struct kvt_chat_msg other[2] = { { "system", "A different document about bees and honey." }, m[1] };
    kvt_session_free(s[0]);
    kvt_session_free(s[1]);
    open_pair(e, fallback, s);
    kvt_token *ot = NULL, *rt = NULL;
    int32_t n_ot = 0, n_rt = 0;
    assert_int_equal(kvt_chat_tokenize(e, other, 2, true, fallback, &ot, &n_ot), 0);
    assert_int_equal(kvt_chat_tokenize(e, m, 2, true, fallback, &rt, &n_rt), 0);
    assert_true(n_ot != n_rt || memcmp(ot, rt, sizeof(kvt_token) * (size_t) n_rt) != 0);
    assert_int_equal(turn_both(e, s[0], s[1], m, 2, other, 2, fallback), 0);
    free(ot);
    free(rt);
    kvt_session_free(s[0]);
    kvt_session_free(s[1]);
    kvt_engine_free(e);
}

static void test_given_tokens(void **state) {
    (void) state;
    char tiny[1024];
    snprintf(tiny, sizeof tiny, "%s/tiny-llama.gguf", getenv("KVT_TINY_DIR"));
    given_tokens_on(tiny, "chatml", false); /* its vocabulary has no special tokens: nothing to split at */
    const char *real[2] = { getenv("KVTIER_MODEL"), getenv("KVTIER_CHAT_MODEL") };
    for (int32_t i = 0; i < 2; i++) {
        if (!real[i] || !*real[i]) {
            printf("skipped: %s not set\n", i ? "KVTIER_CHAT_MODEL" : "KVTIER_MODEL");
            continue;
        }
        given_tokens_on(real[i], "gemma", true);
    }
}

/* Grammar-constrained sampling (kvt_grammar): on Gemma, two sessions stepped together, one under
** the grammar {"n":DIGITS} and one free.  The constrained reply is exactly that shape and ends at
** end-of-generation as soon as the grammar completes; the free one (control, same prompt) is not
** of that shape, so the shape comes from the grammar, not from the prompt.  A GBNF text that does
** not parse is refused with KVT_EINVAL. */
static bool is_n_object(const char *t) {
    if (strncmp(t, "{\"n\":", 5)) return false;
    const char *p = t + 5;
    int digits = 0;
    while (*p >= '0' && *p <= '9') {
        p++;
        digits++;
    }
    return digits >= 1 && digits <= 3 && !strcmp(p, "}");
}

static void test_grammar(void **state) {
    (void) state;
    const char *m = getenv("KVTIER_MODEL");
    if (!m || !*m) {
        printf("skipped: KVTIER_MODEL not set\n");
        return;
    }
    kvt_engine *e = open_real(2);
    kvt_grammar *bad = NULL;
    assert_int_equal(kvt_grammar_new(e, "root ::= \"unterminated", NULL, &bad), KVT_EINVAL);
    assert_null(bad);
    assert_int_equal(kvt_grammar_new(e, "", NULL, &bad), KVT_EINVAL);
    kvt_grammar *g = NULL;
    assert_int_equal(kvt_grammar_new(e, "root ::= \"{\\\"n\\\":\" [0-9]{1,3} \"}\"", NULL, &g), 0);
    const struct kvt_chat_msg msg = { "user", "How many moons does Mars have? Answer in one sentence." };
    kvt_session *ss[2] = { open_real_session(e, 0, KVT_POLICY_KVTIER), open_real_session(e, 1, KVT_POLICY_KVTIER) };
    for (int k = 0; k < 2; k++) assert_int_equal(kvt_session_sync(ss[k], &msg, 1, NULL), 0);
    struct kvt_sampling smp[2] = { { .temperature = 0, .top_p = 1, .grammar = g }, { .temperature = 0, .top_p = 1 } };
    bool over[2] = { false, false };
    int32_t steps[2] = { 0, 0 };
    for (int32_t i = 0; i < 24 && !(over[0] && over[1]); i++) {
        kvt_session *act[2];
        struct kvt_sampling as[2];
        int32_t map[2], n = 0;
        for (int k = 0; k < 2; k++)
            if (!over[k]) {
                act[n] = ss[k];
                as[n] = smp[k];
                map[n++] = k;
            }
        kvt_token tok[2];
        bool done[2];
        int st[2];
        assert_int_equal(
            kvt_session_gen_step_batch(
                e, &(struct kvt_gen_batch){ .sessions = act, .n = n, .smp = as, .tok = tok, .done = done, .status = st }),
            0);
        for (int32_t q = 0; q < n; q++) {
            assert_int_equal(st[q], 0);
            steps[map[q]]++;
            if (done[q]) over[map[q]] = true;
        }
    }
    char *r[2];
    for (int k = 0; k < 2; k++) assert_int_equal(kvt_session_gen_end(ss[k], &r[k]), 0);
    printf("Gemma: constrained '%s' (%d steps, ended %d), free '%.60s'\n", r[0], steps[0], over[0], r[1]);
    assert_true(over[0]); /* ended by end-of-generation, not by the step limit */
    assert_true(is_n_object(r[0]));
    assert_false(is_n_object(r[1])); /* control: without the grammar the model writes prose */
    free(r[0]);
    free(r[1]);
    kvt_session_free(ss[0]);
    kvt_session_free(ss[1]);
    kvt_grammar_free(g);
    kvt_engine_free(e);
}

/* Continuous batching: two sessions stepped together (one llama_decode per step) generate the
** same greedy tokens as each alone, and their replies enter their conversations. */
static void gen_alone(const struct kvt_chat_msg *m, int32_t seq, kvt_token *out, int32_t n) {
    kvt_engine *e = open_tiny(2);
    kvt_session *s = open_session(e, seq, KVT_POLICY_KVTIER);
    assert_int_equal(kvt_session_sync(s, m, 1, NULL), 0);
    struct kvt_sampling smp = { .temperature = 0, .top_p = 1 };
    for (int32_t i = 0; i < n; i++) {
        bool done = false;
        assert_int_equal(kvt_session_gen_step(s, &smp, &out[i], &done), 0);
        if (done) {
            for (int32_t k = i + 1; k < n; k++) out[k] = -1;
            break;
        }
    }
    kvt_session_free(s);
    kvt_engine_free(e);
}

static void test_batch_step(void **state) {
    (void) state;
    enum { N = 12 };
    const struct kvt_chat_msg ma[] = { { "user", "a long story about a dog that ran to the park every day" } };
    const struct kvt_chat_msg mb[] = { { "user", "the sun is hot and the moon is cold" } };
    kvt_token want_a[N], want_b[N], got_a[N], got_b[N];
    gen_alone(ma, 0, want_a, N);
    gen_alone(mb, 1, want_b, N);
    kvt_engine *e = open_tiny(2);
    kvt_session *ss[2] = { open_session(e, 0, KVT_POLICY_KVTIER), open_session(e, 1, KVT_POLICY_KVTIER) };
    assert_int_equal(kvt_session_sync(ss[0], ma, 1, NULL), 0);
    assert_int_equal(kvt_session_sync(ss[1], mb, 1, NULL), 0);
    struct kvt_sampling smp[2] = { { .temperature = 0, .top_p = 1 }, { .temperature = 0, .top_p = 1 } };
    bool fin[2] = { false, false };
    for (int32_t i = 0; i < N; i++) {
        kvt_session *live[2];
        int32_t map[2], n = 0;
        for (int k = 0; k < 2; k++)
            if (!fin[k]) {
                live[n] = ss[k];
                map[n++] = k;
            } else (k ? got_b : got_a)[i] = -1;
        if (n == 0) continue;
        kvt_token tok[2];
        bool done[2];
        int st[2];
        assert_int_equal(
            kvt_session_gen_step_batch(
                e, &(struct kvt_gen_batch){ .sessions = live, .n = n, .smp = smp, .tok = tok, .done = done, .status = st }),
            0);
        for (int32_t k = 0; k < n; k++) {
            assert_int_equal(st[k], 0);
            (map[k] ? got_b : got_a)[i] = done[k] ? -1 : tok[k];
            if (done[k]) fin[map[k]] = true;
        }
    }
    for (int32_t i = 0; i < N; i++) {
        assert_int_equal(got_a[i], want_a[i]);
        assert_int_equal(got_b[i], want_b[i]);
    }
    char *ra = NULL;
    assert_int_equal(kvt_session_gen_end(ss[0], &ra), 0);
    assert_int_equal(kvt_session_gen_end(ss[1], NULL), 0);
    assert_int_equal(kvt_session_n_messages(ss[0]), 2);
    struct kvt_chat_msg last;
    assert_int_equal(kvt_session_message(ss[0], 1, &last), 0);
    assert_string_equal(last.content, ra);
    /* bad input: one session twice (same sequence) */
    kvt_session *twice[2] = { ss[0], ss[0] };
    assert_int_equal(kvt_session_sync(ss[0], ma, 1, NULL), 0);
    kvt_token tok[2];
    bool done[2];
    int st[2];
    int rc = kvt_session_gen_step_batch(
        e, &(struct kvt_gen_batch){ .sessions = twice, .n = 2, .smp = smp, .tok = tok, .done = done, .status = st });
    assert_true(rc == KVT_EINVAL || done[0]);
    free(ra);
    kvt_session_free(ss[0]);
    kvt_session_free(ss[1]);
    kvt_engine_free(e);
}

/* A raw row (no session: a plain completion in a sequence the caller manages) stepped in the same
** llama_decode as a session: its greedy tokens equal the same prompt decoded and sampled alone
** with kvt_engine_decode / kvt_engine_sample, and the session's equal the session's alone. */
static void raw_alone(const char *prompt, int32_t seq, kvt_token *out, int32_t n) {
    kvt_engine *e = open_tiny(3);
    kvt_token *t = NULL;
    int32_t nt = 0;
    assert_int_equal(kvt_tokenize(e, prompt, true, false, &t, &nt), 0);
    assert_int_equal(kvt_engine_decode(e, seq, t, nt, 0, true), 0);
    struct kvt_sampling smp = { .temperature = 0, .top_p = 1 };
    for (int32_t i = 0; i < n; i++) {
        assert_int_equal(kvt_engine_sample(e, &smp, &out[i]), 0);
        if (kvt_token_is_eog(e, out[i])) {
            for (int32_t k = i; k < n; k++) out[k] = -1;
            break;
        }
        assert_int_equal(kvt_engine_decode(e, seq, &out[i], 1, nt + i, true), 0);
    }
    free(t);
    kvt_engine_free(e);
}

static void test_batch_rows(void **state) {
    (void) state;
    enum { N = 12 };
    const struct kvt_chat_msg ma[] = { { "user", "a long story about a dog that ran to the park every day" } };
    const char *prompt = "the sun is hot and the moon is cold and the dog";
    kvt_token want_a[N], want_r[N], got_a[N], got_r[N];
    gen_alone(ma, 0, want_a, N);
    raw_alone(prompt, 2, want_r, N);
    kvt_engine *e = open_tiny(3);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    assert_int_equal(kvt_session_sync(s, ma, 1, NULL), 0);
    kvt_token *t = NULL;
    int32_t nt = 0;
    assert_int_equal(kvt_tokenize(e, prompt, true, false, &t, &nt), 0);
    assert_int_equal(kvt_engine_decode(e, 2, t, nt, 0, true), 0);
    struct kvt_gen_row row;
    memset(&row, 0, sizeof row);
    row.seq = 2;
    row.pos = nt;
    row.logits = malloc(sizeof(float) * (size_t) I.n_vocab);
    memcpy(row.logits, kvt_engine_logits(e), sizeof(float) * (size_t) I.n_vocab);
    row.smp = (struct kvt_sampling){ .temperature = 0, .top_p = 1 };
    struct kvt_sampling smp[1] = { { .temperature = 0, .top_p = 1 } };
    bool fin_a = false, fin_r = false;
    for (int32_t i = 0; i < N; i++) {
        kvt_token tok[1];
        bool done[1];
        int st[1];
        assert_int_equal(kvt_session_gen_step_batch(e, &(struct kvt_gen_batch){ .sessions = &s,
                                                                                .n = fin_a ? 0 : 1,
                                                                                .smp = smp,
                                                                                .tok = tok,
                                                                                .done = done,
                                                                                .status = st,
                                                                                .rows = &row,
                                                                                .n_rows = fin_r ? 0 : 1 }),
                         0);
        got_a[i] = fin_a || done[0] ? -1 : tok[0];
        if (!fin_a) assert_int_equal(st[0], 0);
        fin_a = fin_a || done[0];
        got_r[i] = fin_r || row.done ? -1 : row.tok;
        if (!fin_r) {
            assert_int_equal(row.status, 0);
            assert_int_equal(row.pos, nt + i + (row.done ? 0 : 1));
        }
        fin_r = fin_r || row.done;
    }
    for (int32_t i = 0; i < N; i++) {
        assert_int_equal(got_a[i], want_a[i]);
        assert_int_equal(got_r[i], want_r[i]);
    }
    assert_int_equal(kvt_session_gen_end(s, NULL), 0);
    /* bad input: a row on the session's own sequence; the row is left as it was */
    assert_int_equal(kvt_session_sync(s, ma, 1, NULL), 0);
    kvt_token tok[1];
    bool done[1];
    int st[1];
    row.seq = 0;
    row.done = false;
    const kvt_pos pos0 = row.pos;
    int rc = kvt_session_gen_step_batch(
        e, &(struct kvt_gen_batch){
               .sessions = &s, .n = 1, .smp = smp, .tok = tok, .done = done, .status = st, .rows = &row, .n_rows = 1 });
    assert_true(rc == KVT_EINVAL || done[0] || row.done);
    if (rc) assert_int_equal(row.pos, pos0);
    assert_int_equal(kvt_session_gen_step_batch(e, &(struct kvt_gen_batch){ .n = -1 }), KVT_EINVAL);
    assert_int_equal(kvt_session_gen_end(s, NULL), 0);
    free(row.logits);
    free(t);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* The token stream (kvt_session_tokens) is the template's tokens; a first message that shares a
** long start with the session's keeps the common tokens when synced into it (cut at the first
** token that differs, not at the message boundary before it), and the stream is then exactly the
** template's tokens of the new conversation.  Control: a different first word keeps only the
** template's opening. */
static void test_shared_start(void **state) {
    (void) state;
    kvt_engine *e = open_tiny(2);
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    const struct kvt_chat_msg m1[] = {
        { "user", "the dog ran to the park and the cat sat on the wall and the sun was hot so what did the dog do" }
    };
    const struct kvt_chat_msg m2[] = {
        { "user", "the dog ran to the park and the cat sat on the wall and the sun was hot so what did the cat do" }
    };
    const struct kvt_chat_msg m3[] = {
        { "user", "a dog ran to the park and the cat sat on the wall and the sun was hot so what did the cat do" }
    };
    struct kvt_sync_info si;
    assert_int_equal(kvt_session_sync(s, m1, 1, &si), 0);
    struct kvt_sampling smp = { .temperature = 0, .top_p = 1 };
    for (int32_t i = 0; i < 6; i++) {
        kvt_token t;
        bool done = false;
        assert_int_equal(kvt_session_gen_step(s, &smp, &t, &done), 0);
        if (done) break;
    }
    assert_int_equal(kvt_session_gen_end(s, NULL), 0);
    /* the stream: the template's tokens of m1, then the reply */
    char *f1 = NULL, *f2 = NULL;
    kvt_token *t1 = NULL, *t2 = NULL;
    int32_t n1 = 0, n2 = 0;
    assert_int_equal(kvt_chat_format(e, m1, 1, true, "gemma", &f1), 0);
    assert_int_equal(kvt_chat_format(e, m2, 1, true, "gemma", &f2), 0);
    assert_int_equal(kvt_tokenize(e, f1, true, true, &t1, &n1), 0);
    assert_int_equal(kvt_tokenize(e, f2, true, true, &t2, &n2), 0);
    struct kvt_session_stats st;
    kvt_session_get_stats(s, &st);
    const int32_t total = kvt_session_tokens(s, NULL, 0);
    assert_int_equal(total, st.total_tokens);
    assert_true(total >= n1);
    kvt_token *stream = malloc(sizeof(kvt_token) * (size_t) total);
    kvt_token few[3] = { -7, -7, -7 };
    assert_int_equal(kvt_session_tokens(s, few, 2), total); /* copies only what fits */
    assert_int_equal(few[2], -7);
    assert_int_equal(kvt_session_tokens(s, stream, total), total);
    for (int32_t i = 0; i < n1; i++) assert_int_equal(stream[i], t1[i]);
    assert_int_equal(few[0], stream[0]);
    int32_t common = 0;
    while (common < n1 && common < n2 && t1[common] == t2[common]) common++;
    /* m2 in the session of m1: the common start is kept */
    assert_int_equal(kvt_session_sync(s, m2, 1, &si), 0);
    printf("shared start: prompt %d, reused %d (common tokens %d), decoded %lld\n", si.prompt_tokens, si.tokens_reused, common,
           (long long) si.tokens_decoded);
    assert_int_equal(si.prompt_tokens, n2);
    assert_true(common > n2 / 2);
    assert_int_equal(si.tokens_reused, common);
    assert_int_equal(si.tokens_decoded, n2 - common);
    assert_int_equal(kvt_session_n_messages(s), 1);
    double got = session_logprob(s), want = ref_logprob(e, 1, m2, 1);
    printf("shared start: session %.6f, template %.6f\n", got, want);
    assert_true(fabs(got - want) < TOL);
    assert_int_equal(kvt_session_tokens(s, stream, total), n2);
    for (int32_t i = 0; i < n2; i++) assert_int_equal(stream[i], t2[i]);
    /* control: another first word keeps only the template's opening (its tokens before the text) */
    char *f3 = NULL;
    kvt_token *t3 = NULL;
    int32_t n3 = 0, open3 = 0;
    assert_int_equal(kvt_chat_format(e, m3, 1, true, "gemma", &f3), 0);
    assert_int_equal(kvt_tokenize(e, f3, true, true, &t3, &n3), 0);
    while (open3 < n2 && open3 < n3 && t2[open3] == t3[open3]) open3++;
    assert_int_equal(kvt_session_sync(s, m3, 1, &si), 0);
    printf("different first word: prompt %d, reused %d (template opening %d tokens)\n", si.prompt_tokens, si.tokens_reused, open3);
    assert_int_equal(si.tokens_reused, open3);
    assert_true(open3 < common / 2);
    free(f3);
    free(t3);
    assert_true(fabs(session_logprob(s) - ref_logprob(e, 1, m3, 1)) < TOL);
    free(stream);
    free(f1);
    free(f2);
    free(t1);
    free(t2);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* Chunked prefill: while B prefills a long prompt in steps (kvt_session_prefill), A takes a token
** between B's chunks; A's greedy tokens equal A's alone, B's stream equals the template's tokens. */
struct interleave {
    kvt_session *a;
    kvt_token got[64];
    int32_t n, calls;
};
static void on_chunk_step(void *ud) {
    struct interleave *it = ud;
    struct kvt_sampling smp = { .temperature = 0, .top_p = 1 };
    it->calls++;
    bool done = false;
    if (it->n < 12) {
        assert_int_equal(kvt_session_gen_step(it->a, &smp, &it->got[it->n], &done), 0);
        if (done) it->got[it->n] = -1;
        it->n++;
    }
}

static void test_chunked_prefill(void **state) {
    (void) state;
    const struct kvt_chat_msg ma[] = { { "user", "a long story about a dog that ran to the park every day" } };
    char long_msg[4096] = "";
    for (int i = 0; i < 18; i++) strcat(long_msg, "the cat sat on the mat and the dog ran to the park ");
    const struct kvt_chat_msg mb[] = { { "user", long_msg } };
    kvt_token want[12];
    gen_alone(ma, 0, want, 12);
    kvt_engine *e = open_tiny(2);
    struct interleave it = { 0 };
    it.a = open_session(e, 0, KVT_POLICY_KVTIER);
    kvt_session *b = open_session(e, 1, KVT_POLICY_KVTIER);
    assert_int_equal(kvt_session_sync(it.a, ma, 1, NULL), 0);
    /* B's prompt in steps: A takes a token between B's chunks (a run's last chunk excepted) */
    kvt_prefill *pf = NULL;
    assert_int_equal(kvt_session_prefill(b, mb, 1, NULL, 0, &pf), 0);
    struct kvt_decode_chunk c;
    int r;
    while ((r = kvt_prefill_next(pf, 0, &c)) == 1) {
        assert_int_equal(kvt_prefill_done(pf, kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits)), 0);
        if (!c.want_logits) on_chunk_step(&it);
    }
    assert_int_equal(r, 0);
    struct kvt_sync_info si;
    assert_int_equal(kvt_prefill_end(pf, &si), 0);
    printf("chunked prefill: %d prompt tokens, %d callbacks, %d tokens of A meanwhile\n", si.prompt_tokens, it.calls, it.n);
    assert_true(it.calls >= si.prompt_tokens / 64 - 1);
    assert_int_equal(si.prompt_tokens, ref_tokens(e, mb, 1));
    for (int32_t i = 0; i < it.n && i < 12; i++) {
        if (want[i] < 0) break;
        assert_int_equal(it.got[i], want[i]);
    }
    double got = session_logprob(b);
    assert_int_equal(kvt_session_gen_end(it.a, NULL), 0);
    kvt_session_free(it.a);
    double want_lp = ref_logprob(e, 0, mb, 1);
    printf("B after interleaved prefill %.6f, template %.6f\n", got, want_lp);
    assert_true(fabs(got - want_lp) < TOL_CONC);
    kvt_session_free(b);
    kvt_engine_free(e);
}

/* Park a session (its cells leave the cache, its blocks stay in the pool), let another session
** use the sequence, resume it on another sequence: the conversation continues with no token
** recomputed and the same numbers up to the re-anchoring error (F32: ~1e-4 per logit, docs/ARCHITECTURE.md "Exactness"). */
static void test_park_resume(void **state) {
    (void) state;
    kvt_engine *e = open_tiny(2);
    struct kvt_session_params sp = kvt_session_default_params();
    sp.budget = 256; /* small: some blocks are evicted before parking, they must stay evicted */
    kvt_session *s = NULL;
    assert_int_equal(kvt_session_open(e, &sp, &s), 0);
    char msg[2048] = "";
    for (int i = 0; i < 6; i++) strcat(msg, "the dog ran to the park and the cat sat on the wall ");
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, msg, KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_ASSISTANT, "the cat sat", KVT_KEEP_NONE), 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "what did the cat do", KVT_KEEP_NONE), 0);
    double before = session_logprob(s);
    struct kvt_session_stats st0, st1;
    kvt_session_get_stats(s, &st0);
    assert_int_equal(kvt_session_park(s), 0);
    assert_int_equal(kvt_seq_n_cells(e, 0), 0);
    kvt_session_get_stats(s, &st1);
    assert_int_equal(st1.resident_tokens, 0);
    assert_int_equal(kvt_session_add(s, KVT_ROLE_USER, "x", KVT_KEEP_NONE), KVT_EINVAL); /* parked: refused */
    /* another session on the freed sequence */
    kvt_session *o = open_session(e, 0, KVT_POLICY_KVTIER);
    const struct kvt_chat_msg mo[] = { { "user", "the sun is hot and the moon is cold" } };
    assert_int_equal(kvt_session_sync(o, mo, 1, NULL), 0);
    assert_int_equal(kvt_session_resume(s, 0), KVT_EINVAL); /* not empty */
    assert_int_equal(kvt_session_resume(s, 1), 0);
    kvt_session_get_stats(s, &st1);
    assert_int_equal(st1.tokens_decoded, st0.tokens_decoded); /* nothing recomputed */
    assert_int_equal(st1.resident_tokens, st0.resident_tokens);
    double after = session_logprob(s);
    printf("park/resume: %.6f before, %.6f after (diff %.2e); %d resident tokens came back\n", before, after, fabs(after - before),
           st1.resident_tokens);
    assert_true(fabs(after - before) < 2e-2);
    /* the conversation goes on */
    const struct kvt_chat_msg more[] = { { "user", msg },
                                         { "assistant", "the cat sat" },
                                         { "user", "what did the cat do" },
                                         { "assistant", "it sat" },
                                         { "user", "and the dog" } };
    struct kvt_sync_info si;
    assert_int_equal(kvt_session_sync(s, more, 5, &si), 0);
    assert_true(si.tokens_reused > 0);
    kvt_session_free(o);
    kvt_session_free(s);
    kvt_engine_free(e);
}

/* A prefill in steps stopped part-way, by its caller (kvt_prefill_done(KVT_ECANCELED): a client
** that left) or by ending it with a chunk still out, leaves the session as before the message:
** the same tokens, the same messages; the next sync of the whole conversation then gives the
** log-probability of a session that was never stopped.  Misuse (next with a chunk out, done without one) is refused.
** Control: the same prefill run to its end holds more tokens than before. */
static size_t stream_of(kvt_session *s, kvt_token **out) {
    int32_t n = kvt_session_tokens(s, NULL, 0);
    *out = malloc(sizeof(kvt_token) * (size_t) (n > 0 ? n : 1));
    assert_non_null(*out);
    kvt_session_tokens(s, *out, n);
    return (size_t) n;
}

static void test_prefill_stopped(void **state) {
    (void) state;
    char long_msg[4096] = "";
    for (int i = 0; i < 18; i++) strcat(long_msg, "the keeper of the harbour logged the boats and the storms ");
    struct kvt_chat_msg m[] = { { "user", "what did the keeper log" }, { "assistant", NULL }, { "user", long_msg } };
    kvt_engine *e = open_tiny(2);
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    assert_int_equal(kvt_session_sync(s, m, 1, NULL), 0);
    struct kvt_sampling g = { 0 };
    char *reply = NULL; /* the reply is in the stream: only the long message is new */
    assert_int_equal(kvt_session_generate(s, 4, &g, NULL, NULL, &reply), 0);
    m[1].content = reply;
    kvt_token *t0 = NULL, *t1 = NULL;
    const size_t n0 = stream_of(s, &t0);
    const int32_t msgs0 = kvt_session_n_messages(s);
    for (int how = 0; how < 2; how++) {
        kvt_prefill *pf = NULL;
        assert_int_equal(kvt_session_prefill(s, m, 3, NULL, 0, &pf), 0);
        struct kvt_decode_chunk c;
        assert_int_equal(kvt_prefill_next(pf, 0, &c), 1);
        assert_int_equal(kvt_prefill_done(pf, kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits)), 0);
        assert_int_equal(kvt_prefill_done(pf, 0), KVT_EINVAL); /* no chunk is out */
        assert_int_equal(kvt_prefill_next(pf, 0, &c), 1);
        assert_int_equal(kvt_prefill_next(pf, 0, &c), KVT_EINVAL); /* the chunk out is not done */
        if (how == 0) {
            assert_int_equal(kvt_prefill_done(pf, KVT_ECANCELED), KVT_ECANCELED);
            assert_non_null(strstr(kvt_errmsg(), "stopped"));
            assert_int_equal(kvt_prefill_next(pf, 0, &c), KVT_ECANCELED); /* it stays stopped */
        } else { /* the chunk out is decoded, then the prefill ends without taking it back */
            assert_int_equal(kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits), 0);
        }
        assert_int_equal(kvt_prefill_end(pf, NULL), KVT_ECANCELED);
        const size_t n1 = stream_of(s, &t1);
        printf("prefill stopped (%s): %zu tokens before, %zu after\n", how ? "ended early" : "cancelled", n0, n1);
        assert_int_equal(n1, n0);
        assert_memory_equal(t1, t0, sizeof(kvt_token) * n0);
        assert_int_equal(kvt_session_n_messages(s), msgs0);
        free(t1);
    }
    struct kvt_sync_info si;
    assert_int_equal(kvt_session_sync(s, m, 3, &si), 0); /* control: the whole prefill */
    assert_true((size_t) si.prompt_tokens > n0);
    /* reference: a session on sequence 1 given the same turns with no stopped prefill */
    kvt_session *r = open_session(e, 1, KVT_POLICY_KVTIER);
    struct kvt_sync_info ri;
    char *reply_r = NULL;
    assert_int_equal(kvt_session_sync(r, m, 1, NULL), 0);
    assert_int_equal(kvt_session_generate(r, 4, &g, NULL, NULL, &reply_r), 0);
    assert_string_equal(reply_r, reply);
    assert_int_equal(kvt_session_sync(r, m, 3, &ri), 0);
    assert_int_equal(si.prompt_tokens, ri.prompt_tokens);
    double got = session_logprob(s), want = session_logprob(r);
    printf("after the stopped prefills %.6f, without them %.6f\n", got, want);
    assert_true(fabs(got - want) < TOL_CONC);
    free(reply_r);
    kvt_session_free(r);
    free(t0);
    free(reply);
    kvt_session_free(s);
    kvt_engine_free(e);
}


/* Issue #38: a prefill stopped at ANY chunk boundary of a prompt whose pending text (a system
** prompt, a client's replayed reply) goes in before the user message, then the message, then the
** assistant prefix.  #24 cut back the user message's chunks only: stopped while the pending
** text or the prefix was going in, its chunks stayed in the stream (kv_text lacking them) and
** the retry appended the whole text after them.  For every boundary k, both ways of stopping
** (done(KVT_ECANCELED) and ending with the chunk out, decoded): right after, the stream is what
** it was before the request; the whole request sent again then holds exactly the reference's
** tokens (the template's tokens of the conversation with its prefix) and gives its
** log-probability.  Two starting points: a fresh session (everything pending) and one holding the
** first turn (the replayed reply and a system message pending).  Control: a session whose
** stopped prefill is left as it is (the stream not restored by hand) is longer than before. */
static void stop_at(kvt_engine *e, kvt_session *s, const struct kvt_chat_msg *m, int32_t n, int32_t k, int how) {
    kvt_prefill *pf = NULL;
    struct kvt_decode_chunk c;
    assert_int_equal(kvt_session_prefill(s, m, n, NULL, 0, &pf), 0);
    for (int32_t i = 0; i < k; i++) {
        assert_int_equal(kvt_prefill_next(pf, 64, &c), 1);
        assert_int_equal(kvt_prefill_done(pf, kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits)), 0);
    }
    assert_int_equal(kvt_prefill_next(pf, 64, &c), 1);
    if (how == 0) assert_int_equal(kvt_prefill_done(pf, KVT_ECANCELED), KVT_ECANCELED);
    else assert_int_equal(kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits), 0);
    assert_int_equal(kvt_prefill_end(pf, NULL), KVT_ECANCELED);
}

static int32_t count_chunks(kvt_engine *e, kvt_session *s, const struct kvt_chat_msg *m, int32_t n) {
    kvt_prefill *pf = NULL;
    struct kvt_decode_chunk c;
    int32_t k = 0, r;
    assert_int_equal(kvt_session_prefill(s, m, n, NULL, 0, &pf), 0);
    while ((r = kvt_prefill_next(pf, 64, &c)) == 1) {
        assert_int_equal(kvt_prefill_done(pf, kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits)), 0);
        k++;
    }
    assert_int_equal(r, 0);
    assert_int_equal(kvt_prefill_end(pf, NULL), 0);
    return k;
}

static bool is_boundary(size_t n, const size_t *b, int nb) {
    for (int i = 0; i < nb; i++)
        if (b[i] == n) return true;
    return false;
}

static void test_prefill_stopped_anywhere(void **state) {
    (void) state;
    char sys[2048] = "", ans[1024] = "", q[1024] = "";
    for (int i = 0; i < 10; i++) strcat(sys, "you are the keeper of the harbour and you log the boats ");
    for (int i = 0; i < 6; i++) strcat(ans, "the boats came in and the storm went out to sea ");
    for (int i = 0; i < 6; i++) strcat(q, "which boat came in first after the storm ");
    const struct kvt_chat_msg m[] = { { "system", sys }, { "user", "what did you log" }, { "assistant", ans }, { "user", q } };
    kvt_engine *e = open_tiny(2);
    kvt_session *r = open_session(e, 1, KVT_POLICY_KVTIER); /* the reference: the whole request, never stopped */
    const int32_t n_chunks = count_chunks(e, r, m, 4);
    /* where a stop may leave the stream: the end of a turn's message (its assistant prefix goes on
    ** its own) and of its prefix, for both turns of the request */
    size_t bounds[4];
    const int n_bounds = 4;
    for (int i = 0; i < n_bounds; i++) {
        char *fmt = NULL;
        kvt_token *t = NULL;
        int32_t nt = 0;
        assert_int_equal(kvt_chat_format(e, m, i < 2 ? 2 : 4, i % 2 == 1, "gemma", &fmt), 0);
        assert_int_equal(kvt_tokenize(e, fmt, true, true, &t, &nt), 0);
        bounds[i] = (size_t) nt;
        free(fmt);
        free(t);
    }
    kvt_token *want = NULL, *t0 = NULL, *t1 = NULL;
    const size_t n_want = stream_of(r, &want);
    assert_int_equal((int32_t) n_want, ref_tokens(e, m, 4));
    const double lp_want = session_logprob(r);
    kvt_session_free(r);
    printf("stopped anywhere: %d chunks of at most 64 tokens, %zu tokens in all; turn ends %zu, %zu, %zu, %zu\n", n_chunks, n_want,
           bounds[0], bounds[1], bounds[2], bounds[3]);
    assert_int_equal(bounds[3], n_want);
    assert_true(n_chunks >= 6);
    for (int start = 0; start < 2; start++)
        for (int32_t k = 0; k < n_chunks; k++)
            for (int how = 0; how < 2; how++) {
                kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
                if (start == 1) assert_int_equal(kvt_session_sync(s, m + 1, 1, NULL), 0); /* the first turn, no system yet */
                const size_t n0 = stream_of(s, &t0);
                stop_at(e, s, m, 4, k, how);
                const size_t n1 = stream_of(s, &t1);
                /* the turns of the request that went in whole stay (the stream is then a start of the
                ** reference's); the stopped turn leaves nothing: n1 is a turn boundary of the reference,
                ** or what was there before, or a part of what it shares with the request (c0: a history edited
                ** by the request is cut back before anything is fed) */
                size_t c0 = 0;
                while (c0 < n0 && c0 < n_want && t0[c0] == want[c0]) c0++;
                if (n1 > n_want || (n1 && memcmp(t1, want, sizeof(kvt_token) * n1)) ||
                    (n1 != n0 && n1 > c0 && !is_boundary(n1, bounds, n_bounds)))
                    fail_msg("start %d, stopped at chunk %d (%s): %zu tokens before (%zu shared), %zu after, first %d/%d (not a "
                             "start of the reference's "
                             "%zu ending at one of its turns)",
                             start, k, how ? "ended early" : "cancelled", n0, c0, n1, n1 ? t1[0] : -1, want[0], n_want);
                free(t1);
                struct kvt_sync_info si;
                assert_int_equal(kvt_session_sync(s, m, 4, &si), 0);
                const size_t n2 = stream_of(s, &t1);
                if (n2 != n_want || memcmp(t1, want, sizeof(kvt_token) * n_want))
                    fail_msg("start %d, stopped at chunk %d (%s): the request again holds %zu tokens, the reference %zu", start, k,
                             how ? "ended early" : "cancelled", n2, n_want);
                assert_int_equal(kvt_session_n_messages(s), 4);
                const double lp = session_logprob(s);
                if (fabs(lp - lp_want) >= TOL_CONC)
                    fail_msg("start %d, stopped at chunk %d: log-probability %.6f, the reference %.6f", start, k, lp, lp_want);
                free(t1);
                free(t0);
                kvt_session_free(s);
            }
    /* control: the stream of a stopped prefill holds its decoded chunks until they are cut back;
    ** here the chunks are decoded outside the prefill, as the stream would have them uncut */
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    kvt_prefill *pf = NULL;
    struct kvt_decode_chunk c;
    assert_int_equal(kvt_session_prefill(s, m, 4, NULL, 0, &pf), 0);
    assert_int_equal(kvt_prefill_next(pf, 64, &c), 1);
    assert_int_equal(kvt_prefill_done(pf, kvt_engine_decode(e, c.seq, c.tokens, c.n, c.pos0, c.want_logits)), 0);
    assert_int_equal(kvt_session_tokens(s, NULL, 0), c.n); /* mid-prefill the chunk is in the stream */
    assert_int_equal(kvt_prefill_end(pf, NULL), KVT_ECANCELED);
    assert_int_equal(kvt_session_tokens(s, NULL, 0), 0); /* and the end took it back */
    kvt_session_free(s);
    free(want);
    kvt_engine_free(e);
}

/* Issue #38 item 9: a seeded reply does not depend on what else the engine samples.  The
** engine's cached sampler chain carried the generator, so two sessions with the same settings
** and seed drew from one stream, each taking every other number.  A samples at temperature 1 with
** seed 7 beside B, stepped in turn on a fresh engine each run so that both runs have the same
** cells in the same slots (A's logits bit-identical): B greedy (another chain) in run 1, B with
** A's settings and seed in run 2.  A's tokens must be the same.  Control: A with seed 8 draws
** other tokens (the comparison can fail). */
static void seeded_beside(uint32_t seed_a, const struct kvt_sampling *sb, kvt_token *out, int32_t n) {
    kvt_engine *e = open_tiny(2);
    kvt_session *a = open_session(e, 0, KVT_POLICY_KVTIER), *b = open_session(e, 1, KVT_POLICY_KVTIER);
    const struct kvt_chat_msg ma[] = { { "user", "a long story about a dog that ran to the park every day" } };
    const struct kvt_chat_msg mb[] = { { "user", "the sun is hot and the moon is cold" } };
    assert_int_equal(kvt_session_sync(a, ma, 1, NULL), 0);
    assert_int_equal(kvt_session_sync(b, mb, 1, NULL), 0);
    const struct kvt_sampling sa = { .temperature = 1.0f, .top_p = 1.0f, .seed = seed_a };
    bool done_a = false, done_b = false;
    for (int32_t i = 0; i < n; i++) {
        kvt_token t;
        out[i] = -1;
        if (!done_a) {
            assert_int_equal(kvt_session_gen_step(a, &sa, &t, &done_a), 0);
            out[i] = t;
        }
        if (!done_b) assert_int_equal(kvt_session_gen_step(b, sb, &t, &done_b), 0);
    }
    char *r = NULL;
    kvt_session_gen_end(a, &r);
    free(r);
    kvt_session_gen_end(b, &r);
    free(r);
    kvt_session_free(a);
    kvt_session_free(b);
    kvt_engine_free(e);
}

static void test_seed_own_stream(void **state) {
    (void) state;
    enum { N = 24 };
    kvt_token alone[N], beside[N], other[N];
    const struct kvt_sampling greedy = { .temperature = 0, .top_p = 1 };
    const struct kvt_sampling same = { .temperature = 1.0f, .top_p = 1.0f, .seed = 7 };
    seeded_beside(7, &greedy, alone, N);
    seeded_beside(7, &same, beside, N);
    seeded_beside(8, &greedy, other, N);
    int32_t diff = 0, diff_other = 0;
    for (int32_t i = 0; i < N; i++) {
        diff += alone[i] != beside[i];
        diff_other += alone[i] != other[i];
    }
    printf("seed 7 beside a greedy session vs beside one with seed 7: %d of %d tokens differ; seed 8: %d differ\n", diff, N,
           diff_other);
    assert_int_equal(diff, 0);
    assert_true(diff_other > 0);
}

/* Each sequence's generation draws from one generator of its own, in order (llama.cpp's dist
** sampler seeded with the seed, as a llama-server slot's): on fixed logits, draws 0..N-1 of
** sequence 0 are the stream; sequence 1 drawing the same draws interleaved with sequence 0 gets
** the same tokens (no shared generator); sequence 2 asked for draw K first (out of order) gets
** the stream's K-th token and goes on from there; kvt_engine_sample's own counted stream is the
** same.  Control: another seed gives other tokens (the comparisons can fail). */
static void test_seed_stream_per_sequence(void **state) {
    (void) state;
    enum { N = 24, K = 9 };
    kvt_engine *e = open_tiny(3);
    kvt_token *t = NULL;
    int32_t nt = 0;
    assert_int_equal(kvt_tokenize(e, "the sun is hot and the moon is", true, false, &t, &nt), 0);
    assert_int_equal(kvt_engine_decode(e, 0, t, nt, 0, true), 0);
    const struct kvt_sampling smp = { .temperature = 1.5f, .top_p = 1.0f, .seed = 42 };
    struct kvt_sampling other = smp;
    other.seed = 43;
    kvt_token a[N], b[N], c[N], d[N], o[N];
    for (int32_t i = 0; i < N; i++) assert_int_equal(kvt_engine_sample_at(e, &smp, 0, i, &a[i]), 0);
    for (int32_t i = 0; i < N; i++) { /* sequences 0 and 1 in turn, the same seed */
        assert_int_equal(kvt_engine_sample_at(e, &smp, 0, i, &c[i]), 0);
        assert_int_equal(kvt_engine_sample_at(e, &smp, 1, i, &b[i]), 0);
    }
    for (int32_t i = K; i < N; i++) assert_int_equal(kvt_engine_sample_at(e, &smp, 2, i, &d[i]), 0);
    int32_t distinct = 0, diff_other = 0;
    for (int32_t i = 0; i < N; i++) {
        assert_int_equal(kvt_engine_sample(e, &smp, &o[i]), 0);
        assert_int_equal(b[i], a[i]);
        assert_int_equal(c[i], a[i]);
        assert_int_equal(o[i], a[i]);
        if (i >= K) assert_int_equal(d[i], a[i]);
        distinct += i > 0 && a[i] != a[i - 1];
    }
    for (int32_t i = 0; i < N; i++) {
        kvt_token x;
        assert_int_equal(kvt_engine_sample_at(e, &other, 1, i, &x), 0);
        diff_other += x != a[i];
    }
    printf("one stream per sequence: %d of %d successive draws differ; seed 43: %d of %d tokens differ\n", distinct, N - 1,
           diff_other, N);
    /* the draws are random, not one token; the control */
    assert_true(distinct > 0);
    assert_true(diff_other > 0);
    assert_int_equal(kvt_engine_sample_at(e, &smp, 1000, 0, &o[0]), KVT_EINVAL); /* no such sequence */
    assert_int_equal(kvt_engine_sample_at(e, &smp, -2, 0, &o[0]), KVT_EINVAL);
    free(t);
    kvt_engine_free(e);
}

/* llama.cpp's penalties sampler, computed here by its definition: over the window win[0..n), a
** token seen c > 0 times has its logit divided by rep (multiplied when <= 0), then minus freq * c
** and presence once.  The argmax of the logits so penalized. */
static kvt_token penalized_argmax(const float *l, int32_t nv, const kvt_token *win, int32_t n, float rep, float freq, float pres) {
    kvt_token best = -1;
    float bl = -INFINITY;
    for (int32_t v = 0; v < nv; v++) {
        int32_t c = 0;
        for (int32_t i = 0; i < n; i++) c += win[i] == v;
        float x = l[v];
        if (c > 0) {
            x = x <= 0 ? x * rep : x / rep;
            x -= (float) c * freq + pres;
        }
        if (x > bl) bl = x, best = v;
    }
    return best;
}

/* Repetition penalties (struct kvt_sampling: repeat, frequency, presence over the last
** penalty_last_n tokens) as llama-server applies them: a session's greedy reply, token by token,
** is the argmax of its logits penalized by definition over the window of the conversation's
** template tokens and the reply so far (computed here from kvt_chat_tokenize, not from the
** session); raw sampling takes the caller's history, of which only the last penalty_last_n
** tokens count.  Control: the penalties change the argmax at some of the steps (the comparison
** is not vacuous), and without them the reply is the plain argmax. */
static void test_penalties(void **state) {
    (void) state;
    enum { N = 40, W = 32 };
    const struct kvt_chat_msg m[] = { { "user", "the cat sat on the mat and the cat sat on the mat and the cat" } };
    kvt_engine *e = open_tiny(1);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    kvt_session *s = open_session(e, 0, KVT_POLICY_KVTIER);
    assert_int_equal(kvt_session_sync(s, m, 1, NULL), 0);
    kvt_token *stream = NULL;
    int32_t n_stream = 0;
    assert_int_equal(kvt_chat_tokenize(e, m, 1, true, kvt_session_default_params().template_fallback, &stream, &n_stream), 0);
    stream = realloc(stream, sizeof *stream * (size_t) (n_stream + N));
    assert_non_null(stream);
    struct kvt_sampling smp = {
        .top_p = 1, .repeat_penalty = 4.0f, .frequency_penalty = 2.0f, .presence_penalty = 2.0f, .penalty_last_n = W
    };
    float *l = malloc(sizeof *l * (size_t) I.n_vocab);
    assert_non_null(l);
    int32_t changed = 0, steps = 0;
    for (int32_t i = 0; i < N; i++) {
        memcpy(l, kvt_session_logits(s), sizeof *l * (size_t) I.n_vocab);
        const int32_t w = n_stream < W ? n_stream : W;
        const kvt_token want = penalized_argmax(l, I.n_vocab, stream + n_stream - w, w, 4.0f, 2.0f, 2.0f);
        changed += want != penalized_argmax(l, I.n_vocab, NULL, 0, 1, 0, 0);
        kvt_token t;
        bool done = false;
        if (i == 3) { /* the penalties' allocation fails: KVT_ENOMEM, nothing fed; the step again is the same */
            kvt__fault_set(KVT__FAULT_PENALTIES, 0, 1);
            assert_int_equal(kvt_session_gen_step(s, &smp, &t, &done), KVT_ENOMEM);
            assert_int_equal(kvt__fault_hits(KVT__FAULT_PENALTIES), 1);
            assert_false(done);
        }
        assert_int_equal(kvt_session_gen_step(s, &smp, &t, &done), 0);
        assert_int_equal(t, want);
        steps++;
        if (done) break;
        stream[n_stream++] = t;
    }
    printf("penalties: %d greedy steps, each the argmax penalized by definition; the penalties changed it at %d\n", steps, changed);
    assert_true(changed > 0);
    assert_true(steps > 3); /* the failing step (3) was reached */
    assert_int_equal(kvt_session_gen_end(s, NULL), 0);
    /* raw sampling: the history's last W tokens count, not the ones before; NULL history: none */
    kvt_session_free(s);
    assert_int_equal(kvt_engine_decode(e, 0, stream, 24, 0, true), 0);
    memcpy(l, kvt_engine_logits(e), sizeof *l * (size_t) I.n_vocab);
    const kvt_token top = penalized_argmax(l, I.n_vocab, NULL, 0, 1, 0, 0);
    kvt_token hist[3 * W], t;
    for (int32_t i = 0; i < 3 * W; i++) hist[i] = i < 2 * W ? (kvt_token) (i + 1) : top; /* the top token in the window */
    smp = (struct kvt_sampling){
        .top_p = 1, .presence_penalty = 2, .frequency_penalty = 1, .penalty_last_n = W, .history = hist, .n_history = 3 * W
    };
    kvt__fault_set(KVT__FAULT_PENALTIES, 0, 1);
    assert_int_equal(kvt_engine_sample(e, &smp, &t), KVT_ENOMEM);
    assert_int_equal(kvt_engine_sample(e, &smp, &t), 0);
    assert_int_equal(t, penalized_argmax(l, I.n_vocab, hist + 2 * W, W, 1, 1, 2));
    assert_int_not_equal(t, top);
    for (int32_t i = 0; i < 3 * W; i++) hist[i] = i < W ? top : (kvt_token) (i + 1); /* the top token before it */
    assert_int_equal(kvt_engine_sample(e, &smp, &t), 0);
    assert_int_equal(t, top);
    smp.history = NULL;
    assert_int_equal(kvt_engine_sample(e, &smp, &t), 0);
    assert_int_equal(t, top);
    free(l);
    free(stream);
    kvt_engine_free(e);
}

/* ---- llama-server's other samplers, each against its definition computed here ------------- */

/* p[v] = softmax of l over the tokens keep[] (all: NULL) at temperature t, in double; 0 outside. */
static void ref_softmax(const float *l, int32_t nv, const bool *keep, double t, double *p) {
    double mx = -INFINITY, z = 0;
    for (int32_t v = 0; v < nv; v++)
        if (!keep || keep[v]) mx = fmax(mx, l[v]);
    for (int32_t v = 0; v < nv; v++) z += (p[v] = !keep || keep[v] ? exp((l[v] - mx) / t) : 0);
    for (int32_t v = 0; v < nv; v++) p[v] /= z;
}

/* The n largest of p[], decreasing: ids into top[0 .. n) (O(nv n): n is small). */
static void ref_top(const double *p, int32_t nv, int32_t n, kvt_token *top) {
    for (int32_t i = 0; i < n; i++) {
        top[i] = -1;
        for (int32_t v = 0; v < nv; v++) {
            bool taken = false;
            for (int32_t k = 0; k < i && !taken; k++) taken = top[k] == v;
            if (!taken && (top[i] < 0 || p[v] > p[top[i]])) top[i] = v;
        }
    }
}

/* kvt_sampling.post[1 .. n] is the reference distribution p's n likeliest tokens, each with its
** probability within tol (a listed token's own, and the i-th largest), none listed where p has
** nothing above tol left.  Returns the largest difference seen. */
static double check_post(const struct kvt_token_p *post, int32_t n, const double *p, int32_t nv, double tol) {
    kvt_token top[32];
    assert_true(n <= 32);
    ref_top(p, nv, n, top);
    double worst = 0;
    for (int32_t i = 1; i <= n; i++) {
        const double want = p[top[i - 1]];
        if (post[i].tok < 0) {
            assert_true(want < tol);
            continue;
        }
        worst = fmax(worst, fmax(fabs(post[i].p - p[post[i].tok]), fabs(post[i].p - want)));
    }
    assert_true(worst < tol);
    return worst;
}

static const double *g_score; /* the sort key of by_score */
static int by_score(const void *a, const void *b) {
    const double x = g_score[*(const kvt_token *) a], y = g_score[*(const kvt_token *) b];
    return x < y ? -1 : x > y;
}

/* Gemma 3 after a story's opening, whose next token has many likely candidates: the engine (3
** sequences), its next-token logits l[nv] on sequence 0, their softmax p at temperature 1, and
** scratch of the vocabulary's size (q, sc, keep, idx). */
struct story {
    kvt_engine *e;
    int32_t nv;
    float *l;
    double *p, *q, *sc;
    bool *keep;
    kvt_token *idx;
};

static void story_open(struct story *st) {
    st->e = open_real(3);
    struct kvt_engine_info I;
    kvt_engine_info(st->e, &I);
    const size_t nv = (size_t) (uint32_t) (st->nv = I.n_vocab);
    kvt_token *t = NULL;
    int32_t nt = 0;
    assert_int_equal(kvt_tokenize(st->e, "Once upon a time, in a small village by the sea, there lived a", true, false, &t, &nt),
                     0);
    assert_int_equal(kvt_engine_decode(st->e, 0, t, nt, 0, true), 0);
    free(t);
    st->l = malloc(sizeof *st->l * nv);
    st->p = malloc(sizeof *st->p * nv), st->q = malloc(sizeof *st->q * nv), st->sc = malloc(sizeof *st->sc * nv);
    st->keep = malloc(nv);
    st->idx = malloc(sizeof *st->idx * nv);
    assert_true(st->l && st->p && st->q && st->sc && st->keep && st->idx);
    memcpy(st->l, kvt_engine_logits(st->e), sizeof *st->l * nv);
    ref_softmax(st->l, st->nv, NULL, 1.0, st->p);
}

static void story_free(struct story *st) {
    free(st->keep);
    free(st->sc);
    free(st->q);
    free(st->p);
    free(st->l);
    free(st->idx);
    kvt_engine_free(st->e);
}

/* Whether typical_p = pt keeps exactly idx[0 .. k) (the k tokens of smallest sc = |-ln p - H|,
** cum of the mass) when the entropy it is measured from is off H by up to dh nats (checked every
** dh / 10, with that much room): for each such centre the set's tokens are nearer it than the
** rest, and the running sum passes pt (by 1e-4) at the set's last token, whichever that is. */
static bool typical_robust(const double *p, const double *sc, double H, const kvt_token *idx, int32_t nv, int32_t k, double cum,
                           double pt, double dh) {
    const double step = dh / 10;
    if (!(cum > pt + 1e-4)) return false;
    for (double ctr = H - dh; ctr <= H + dh + step / 2; ctr += step) {
        double in = -1, out = INFINITY;
        int32_t last = -1;
        for (int32_t i = 0; i < k; i++) {
            const double x = fabs(-log(p[idx[i]]) - ctr);
            if (x > in) in = x, last = idx[i];
        }
        /* idx is by sc, and |-ln p - ctr| >= sc - dh: the rest cannot be nearer */
        for (int32_t i = k; i < nv && p[idx[i]] > 0 && sc[idx[i]] - dh <= out; i++) out = fmin(out, fabs(-log(p[idx[i]]) - ctr));
        if (!(in < out - step) || !(cum - p[last] < pt - 1e-4)) return false;
    }
    return true;
}

/* top_n_sigma, typical_p, XTC and the dynamic temperature (struct kvt_sampling) on a real model's
** next-token logits, each against its definition computed here from the same logits in double
** (the papers' and llama.cpp's: logits within n standard deviations of the largest; the smallest
** set of tokens of surprisal nearest the entropy holding p of the mass; every token of probability
** >= the threshold but the least likely of them; the temperature range scaled by the normalised
** entropy of the candidates): the probabilities drawn from (kvt_sampling.post) and the greedy token.
** XTC draws from a generator of its own per generation: with probability 0.5 a greedy generation
** takes the argmax or the XTC token, both seen; another sequence interleaved with the same seed,
** one that starts at draw K, and kvt_engine_sample's counted stream give the same tokens; its
** allocation failing is KVT_ENOMEM and the draw again succeeds.  Controls: each sampler's
** distribution differs from the one without it (the comparisons are not vacuous), typical_p at
** temperature 0 leaves the argmax at one p at least. */
static void test_more_samplers(void **state) {
    (void) state;
    enum { NP = 24, N = 32, K = 11 };
    struct story st;
    story_open(&st);
    kvt_engine *e = st.e;
    const int32_t nv = st.nv;
    const float *l = st.l;
    double *p = st.p, *q = st.q, *sc = st.sc;
    bool *keep = st.keep;
    kvt_token *idx = st.idx;
    kvt_token top[2];
    ref_top(p, nv, 2, top);
    struct kvt_token_p post[NP + 1];
    kvt_token tok;
    const double tol = 2e-4;

    /* top_n_sigma: n off any logit's distance from the cut by 1e-3 at least */
    double mx = -INFINITY, mean = 0, var = 0;
    for (int32_t v = 0; v < nv; v++) mx = fmax(mx, l[v]), mean += l[v] / nv;
    for (int32_t v = 0; v < nv; v++) var += (l[v] - mean) * (l[v] - mean) / nv;
    double n_sigma = 1.0, margin = 0;
    for (; n_sigma < 3; n_sigma += 0.05) {
        margin = INFINITY;
        for (int32_t v = 0; v < nv; v++) margin = fmin(margin, fabs(l[v] - (mx - n_sigma * sqrt(var))));
        if (margin > 1e-3) break;
    }
    int32_t n_keep = 0;
    for (int32_t v = 0; v < nv; v++) n_keep += (keep[v] = l[v] >= mx - n_sigma * sqrt(var));
    ref_softmax(l, nv, keep, 1.0, q);
    struct kvt_sampling smp = {
        .temperature = 1, .top_p = 1, .seed = 5, .top_n_sigma = (float) n_sigma, .post = post, .n_post = NP
    };
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
    const double d_sigma = check_post(post, NP, q, nv, tol);
    assert_true(keep[tok]);
    assert_true(n_keep < nv && fabs(q[top[0]] - p[top[0]]) > 1e-3); /* control: it cut the distribution */

    /* typical_p: the tokens by |surprisal - entropy|, up to p of the mass (llama.cpp keeps the token
    ** that passes p).  llama.cpp sums the entropy in float over the whole vocabulary (Gemma 3's 262k
    ** tokens): 4e-4 nats off double's on an AMD EPYC, which swapped two tokens on either side of it
    ** whose scores differ by 8e-4.  So p is taken halfway between the running sums around the cut
    ** near 0.05, 0.10, ... 0.95, and used where the set is the same for any entropy within 0.01 nats
    ** (typical_robust) */
    double H = 0;
    for (int32_t v = 0; v < nv; v++)
        if (p[v] > 0) H -= p[v] * log(p[v]);
    for (int32_t v = 0; v < nv; v++) sc[v] = p[v] > 0 ? fabs(-log(p[v]) - H) : INFINITY, idx[v] = v;
    g_score = sc;
    qsort(idx, (size_t) nv, sizeof *idx, by_score);
    int32_t n_typ = 0, not_argmax = 0;
    for (int32_t f = 1; f < 20; f++) {
        double cum = 0, prev = 0;
        int32_t k = 0;
        while (k < nv && cum <= f / 20.0) prev = cum, cum += p[idx[k++]];
        const double pt = (prev + cum) / 2;
        if (k >= nv || !typical_robust(p, sc, H, idx, nv, k, cum, pt, 0.01)) continue;
        memset(keep, 0, (size_t) nv);
        kvt_token best = idx[0];
        for (int32_t i = 0; i < k; i++) {
            keep[idx[i]] = true;
            if (l[idx[i]] > l[best]) best = idx[i];
        }
        ref_softmax(l, nv, keep, 1.0, q);
        smp = (struct kvt_sampling){ .temperature = 1, .top_p = 1, .seed = 5, .typical_p = (float) pt, .post = post, .n_post = NP };
        assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
        check_post(post, NP, q, nv, tol);
        assert_true(keep[tok]);
        smp = (struct kvt_sampling){ .top_p = 1, .typical_p = (float) pt }; /* greedy: the argmax of the typical set */
        assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
        assert_int_equal(tok, best);
        not_argmax += best != top[0];
        n_typ++;
    }
    assert_true(n_typ >= 3);
    assert_true(not_argmax > 0);

    /* XTC: threshold just under the second likeliest token's probability, so that two tokens at
    ** least pass it; those that pass, but the least likely of them, are dropped */
    assert_true(p[top[1]] <= 0.5);
    double thr = p[top[1]] * 0.98;
    int32_t m = 0;
    kvt_token last = -1;
    for (int32_t v = 0; v < nv; v++) {
        assert_true(fabs(p[v] - thr) > 1e-5);
        if ((keep[v] = p[v] < thr)) continue;
        m++;
        if (last < 0 || p[v] < p[last]) last = v;
    }
    keep[last] = true;
    assert_true(m >= 2);
    ref_softmax(l, nv, keep, 1.0, q);
    smp = (struct kvt_sampling){
        .temperature = 1, .top_p = 1, .seed = 5, .xtc_probability = 1, .xtc_threshold = (float) thr, .post = post, .n_post = NP
    };
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
    check_post(post, NP, q, nv, tol);
    assert_true(keep[tok] && tok != top[0]);
    smp = (struct kvt_sampling){ .top_p = 1, .xtc_probability = 1, .xtc_threshold = (float) thr };
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
    assert_int_equal(tok, last); /* greedy after XTC: the least likely of those that passed */
    smp.xtc_threshold = 0.6f;    /* above 0.5: off */
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
    assert_int_equal(tok, top[0]);
    /* greedy with top_k 2 and XTC: llama-server's temperature 0 keeps its chain, so XTC judges the two
    ** renormalised (both pass a threshold just under the second's share) and the second is the token */
    const double share = p[top[1]] / (p[top[0]] + p[top[1]]);
    smp = (struct kvt_sampling){ .top_p = 1, .top_k = 2, .xtc_probability = 1, .xtc_threshold = (float) (share * 0.98) };
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
    assert_int_equal(tok, top[1]);
    /* probability 0.5: one generator per generation, in order */
    smp = (struct kvt_sampling){ .top_p = 1, .seed = 42, .xtc_probability = 0.5f, .xtc_threshold = (float) thr };
    kvt_token a[N], b[N], c[N], d[N], o[N];
    for (int32_t i = 0; i < N; i++) assert_int_equal(kvt_engine_sample_at(e, &smp, 0, i, &a[i]), 0);
    for (int32_t i = 0; i < N; i++) {
        assert_int_equal(kvt_engine_sample_at(e, &smp, 0, i, &c[i]), 0);
        assert_int_equal(kvt_engine_sample_at(e, &smp, 1, i, &b[i]), 0);
    }
    for (int32_t i = K; i < N; i++) assert_int_equal(kvt_engine_sample_at(e, &smp, 2, i, &d[i]), 0);
    int32_t n_xtc = 0;
    for (int32_t i = 0; i < N; i++) {
        assert_int_equal(kvt_engine_sample(e, &smp, &o[i]), 0);
        assert_true(a[i] == top[0] || a[i] == last);
        n_xtc += a[i] == last;
        assert_int_equal(b[i], a[i]);
        assert_int_equal(c[i], a[i]);
        assert_int_equal(o[i], a[i]);
        if (i >= K) assert_int_equal(d[i], a[i]);
    }
    assert_true(n_xtc > 0 && n_xtc < N);
    kvt__fault_set(KVT__FAULT_XTC, 0, 1);
    assert_int_equal(kvt_engine_sample_at(e, &smp, 1, 0, &tok), KVT_ENOMEM);
    assert_int_equal(kvt__fault_hits(KVT__FAULT_XTC), 1);
    assert_int_equal(kvt_engine_sample_at(e, &smp, 1, 0, &tok), 0);
    assert_int_equal(tok, a[0]);

    /* the dynamic temperature over top_k 40: 1 +- 0.5 by the candidates' normalised entropy */
    memset(keep, 0, (size_t) nv);
    {
        kvt_token t40[32];
        ref_top(p, nv, 32, t40); /* the 40 largest: the 32 here and 8 more found below */
        for (int32_t i = 0; i < 32; i++) keep[t40[i]] = true;
        for (int32_t extra = 0; extra < 8; extra++) {
            kvt_token bst = -1;
            for (int32_t v = 0; v < nv; v++)
                if (!keep[v] && (bst < 0 || p[v] > p[bst])) bst = v;
            keep[bst] = true;
        }
    }
    ref_softmax(l, nv, keep, 1.0, q);
    double h40 = 0;
    for (int32_t v = 0; v < nv; v++)
        if (q[v] > 0) h40 -= q[v] * log(q[v]);
    const double dyn = 0.5 + 1.0 * (h40 / log(40.0));
    ref_softmax(l, nv, keep, 1.0, p); /* the control: temperature 1 on the same 40 */
    ref_softmax(l, nv, keep, dyn, q);
    smp = (struct kvt_sampling){ .temperature = 1,
                                 .top_p = 1,
                                 .top_k = 40,
                                 .seed = 5,
                                 .dynatemp_range = 0.5f,
                                 .dynatemp_exponent = 1,
                                 .post = post,
                                 .n_post = NP };
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &tok), 0);
    const double d_dyn = check_post(post, NP, q, nv, tol);
    double ctl = 0;
    for (int32_t v = 0; v < nv; v++) ctl = fmax(ctl, fabs(p[v] - q[v]));
    assert_true(ctl > 1e-3);
    printf("samplers by definition: top_n_sigma %.2f keeps %d (margin %.1e, max diff %.1e); typical_p at %d p, greedy off "
           "the argmax at %d; XTC threshold %.3f drops %d tokens, 0.5 fired %d of %d draws; dynatemp T %.3f (max diff %.1e, "
           "%.1e from T 1)\n",
           n_sigma, n_keep, margin, d_sigma, n_typ, not_argmax, thr, m - 1, n_xtc, N, dyn, d_dyn, ctl);
    story_free(&st);
}

/* Mirostat as llama.cpp defines it (Basu et al. 2021), on Gemma 3's next-token logits at
** temperature 1, against its definition computed here in double.  2.0: mu = 2 tau bits at the
** first draw; the candidates of surprise -log2 p <= mu (one at least) renormalised are what the
** draw comes from (kvt_sampling.post); then mu -= eta (surprise of the drawn token - tau), tracked
** here from the drawn tokens, so each later draw's candidates are checked at the mu the generation
** reached.  1.0's first draw: the top k by Zipf's exponent estimated from the 100 likeliest
** (k = (eps 2^mu / (1 - n_vocab^-eps))^(1 / s)).  One generator and mu per generation: another
** sequence interleaved gets the same tokens; a draw out of order starts it again (its token is
** draw 0's); penalties do not apply (llama-server's chain with Mirostat has none); the allocation
** failing is KVT_ENOMEM.  Control: mu moves the candidate set (two sizes at least). */
static void test_mirostat(void **state) {
    (void) state;
    enum { NP = 24, N = 12 };
    struct story st;
    story_open(&st);
    kvt_engine *e = st.e;
    const int32_t nv = st.nv;
    const size_t nvz = (size_t) (uint32_t) nv;
    const float *l = st.l;
    double *p = st.p, *q = st.q, *sc = st.sc;
    bool *keep = st.keep;
    kvt_token *idx = st.idx;
    for (int32_t v = 0; v < nv; v++) sc[v] = -p[v], idx[v] = v; /* idx: by probability, decreasing */
    g_score = sc;
    qsort(idx, (size_t) nv, sizeof *idx, by_score);
    struct kvt_token_p post[NP + 1];
    const double tau = 2.0, eta = 1.0, tol = 2e-4;

    /* 2.0, draw after draw */
    struct kvt_sampling smp = { .temperature = 1,
                                .top_p = 1,
                                .seed = 9,
                                .mirostat = 2,
                                .mirostat_tau = (float) tau,
                                .mirostat_eta = (float) eta,
                                .post = post,
                                .n_post = NP };
    double mu = 2 * tau;
    kvt_token a[N];
    int32_t checked = 0, sizes[N], n_sizes = 0;
    for (int32_t i = 0; i < N; i++) {
        int32_t k = 0;
        double margin = INFINITY;
        for (int32_t r = 0; r < nv && p[idx[r]] > 0; r++) {
            const double surprise = -log2(p[idx[r]]);
            margin = fmin(margin, fabs(surprise - mu));
            if (surprise <= mu) k = r + 1;
        }
        if (k == 0) k = 1;
        memset(keep, 0, nvz);
        for (int32_t r = 0; r < k; r++) keep[idx[r]] = true;
        ref_softmax(l, nv, keep, 1.0, q);
        assert_int_equal(kvt_engine_sample_at(e, &smp, 0, i, &a[i]), 0);
        if (margin < 1e-3) break; /* a candidate on the cut: float and double may disagree from here on */
        check_post(post, NP, q, nv, tol);
        assert_true(keep[a[i]]);
        bool seen = false;
        for (int32_t j = 0; j < n_sizes && !seen; j++) seen = sizes[j] == k;
        if (!seen) sizes[n_sizes++] = k;
        mu -= eta * (-log2(q[a[i]]) - tau);
        checked++;
    }
    assert_true(checked >= 4);
    assert_true(n_sizes >= 2);
    /* the same generation on sequence 1, interleaved with sequence 0's again: the same tokens; with
    ** penalties (not in Mirostat's chain) too */
    kvt_token hist[8];
    for (int32_t i = 0; i < 8; i++) hist[i] = idx[i % 3];
    struct kvt_sampling pen = smp;
    pen.post = NULL;
    pen.repeat_penalty = 4, pen.frequency_penalty = 2, pen.history = hist, pen.n_history = 8;
    for (int32_t i = 0; i < checked; i++) {
        kvt_token x, y;
        assert_int_equal(kvt_engine_sample_at(e, &smp, 0, i, &x), 0);
        assert_int_equal(kvt_engine_sample_at(e, &pen, 1, i, &y), 0);
        assert_int_equal(x, a[i]);
        assert_int_equal(y, a[i]);
    }
    kvt_token x;
    assert_int_equal(kvt_engine_sample_at(e, &smp, 2, 5, &x), 0); /* out of order: started again */
    assert_int_equal(x, a[0]);
    kvt__fault_set(KVT__FAULT_XTC, 0, 1);
    assert_int_equal(kvt_engine_sample_at(e, &smp, 2, 0, &x), KVT_ENOMEM);
    assert_int_equal(kvt_engine_sample_at(e, &smp, 2, 0, &x), 0);
    assert_int_equal(x, a[0]);
    smp.temperature = 0; /* greedy: the argmax */
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &x), 0);
    assert_int_equal(x, idx[0]);

    /* 1.0's first draw at mu = 2 tau: top k by the estimated Zipf exponent (k off an integer by 1e-2) */
    double ktop = 0, num = 0, den = 0;
    double tau1 = 1.0;
    bool found = false;
    for (; tau1 < 16; tau1 += 0.25) {
        num = den = 0;
        for (int32_t i = 0; i < 99; i++) {
            const double ti = log((i + 2.0) / (i + 1.0)), bi = log(p[idx[i]] / p[idx[i + 1]]);
            num += ti * bi, den += ti * ti;
        }
        const double s_hat = num / den, eps = s_hat - 1;
        ktop = pow(eps * pow(2, 2 * tau1) / (1 - pow(nv, -eps)), 1 / s_hat);
        if ((found = fabs(ktop - round(ktop)) > 1e-2 && ktop > 2 && ktop < NP)) break;
    }
    assert_true(found); /* else tau1 is past the k computed (an AMD EPYC: s_hat 0.41, k 1.15 at tau 5.75) */
    const int32_t k1 = ktop < 1 ? 1 : (int32_t) ktop;
    memset(keep, 0, nvz);
    for (int32_t r = 0; r < k1; r++) keep[idx[r]] = true;
    ref_softmax(l, nv, keep, 1.0, q);
    smp = (struct kvt_sampling){ .temperature = 1,
                                 .top_p = 1,
                                 .seed = 9,
                                 .mirostat = 1,
                                 .mirostat_tau = (float) tau1,
                                 .mirostat_eta = (float) eta,
                                 .post = post,
                                 .n_post = NP };
    assert_int_equal(kvt_engine_sample_at(e, &smp, 0, 0, &x), 0);
    check_post(post, NP, q, nv, tol);
    assert_true(keep[x]);
    printf("Mirostat 2.0: %d draws checked, %d candidate-set sizes (mu to %.2f); 1.0: tau %.2f keeps the top %d (k %.3f)\n",
           checked, n_sizes, mu, tau1, k1, ktop);
    story_free(&st);
}

/* DRY's penalty by its definition (llama.cpp's DRY sampler, no sequence breaker in the window w[0..n)):
** for every earlier position j whose tokens w[.. j] match the window's last ones for m tokens, the
** token after it, w[j + 1], would extend a repeat of length m; the longest m of each token, when at
** least allowed, lowers its logit by mult * base ^ (m - allowed).  pen[0 .. nv) must start at 0. */
static void dry_ref(const kvt_token *w, int32_t n, double mult, double base, int32_t allowed, double *pen) {
    int32_t *best = calloc((size_t) n, sizeof *best);
    assert_non_null(best);
    for (int32_t j = 0; j + 1 < n; j++) {
        int32_t m = 0;
        while (m <= j && w[j - m] == w[n - 1 - m]) m++;
        best[j] = m;
    }
    for (int32_t j = 0; j + 1 < n; j++) {
        int32_t m = 0;
        for (int32_t k = 0; k + 1 < n; k++)
            if (w[k + 1] == w[j + 1] && best[k] > m) m = best[k];
        if (m >= allowed) pen[w[j + 1]] = mult * pow(base, m - allowed);
    }
    free(best);
}

/* DRY (struct kvt_sampling.dry_*) on Gemma 3's next-token logits after a text that repeats a phrase,
** against its definition computed here: greedy is the argmax of the logits so penalised, the
** post-sampling probabilities their softmax; only the last dry_penalty_last_n tokens of the history
** count; its sampler failing to allocate is KVT_ENOMEM and the draw again succeeds; Mirostat's chain
** has no DRY.  A session's greedy reply, step by step, is the argmax penalised over the window of
** its stream (the template tokens and the reply so far, computed here from kvt_chat_tokenize).
** Controls: DRY changes the argmax after the repeat (the comparison is not vacuous). */
/* DRY samplers the engine made for `rounds` rounds of n settings drawn in turn (multipliers from m0 up). */
static int64_t dry_rounds(kvt_engine *e, struct kvt_sampling *smp, float m0, int n, int rounds) {
    const int64_t made = kvt_engine_test_dry_made(e);
    kvt_token tok;
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < n; k++) {
            smp->dry_multiplier = m0 + (float) k;
            assert_int_equal(kvt_engine_sample(e, smp, &tok), 0);
        }
    return kvt_engine_test_dry_made(e) - made;
}

static void test_dry(void **state) {
    (void) state;
    enum { NP = 24, N = 24, W = 48 };
    kvt_engine *e = open_real(1);
    struct kvt_engine_info I;
    kvt_engine_info(e, &I);
    const int32_t nv = I.n_vocab;
    kvt_token *t = NULL;
    int32_t nt = 0;
    assert_int_equal(kvt_tokenize(e,
                                  "the old cat sat on the warm mat . the old cat sat on the warm mat . the old cat sat on the warm",
                                  false, false, &t, &nt),
                     0);
    assert_true(nt > 20 && nt <= W);
    assert_int_equal(kvt_engine_decode(e, 0, t, nt, 0, true), 0);
    float *l = malloc(sizeof *l * (size_t) nv);
    double *pen = calloc((size_t) nv, sizeof *pen), *q = malloc(sizeof *q * (size_t) nv);
    assert_true(l && pen && q);
    memcpy(l, kvt_engine_logits(e), sizeof *l * (size_t) nv);
    dry_ref(t, nt, 2.0, 1.75, 2, pen);
    float *lp = malloc(sizeof *lp * (size_t) nv);
    assert_non_null(lp);
    kvt_token top = 0, top_pen = 0;
    for (int32_t v = 0; v < nv; v++) {
        lp[v] = (float) (l[v] - pen[v]);
        if (l[v] > l[top]) top = v;
        if (lp[v] > lp[top_pen]) top_pen = v;
    }
    struct kvt_token_p post[NP + 1];
    struct kvt_sampling smp = { .top_p = 1,
                                .dry_multiplier = 2,
                                .dry_base = 1.75f,
                                .dry_allowed_length = 2,
                                .dry_penalty_last_n = W,
                                .history = t,
                                .n_history = nt };
    kvt_token tok;
    assert_int_equal(kvt_engine_sample(e, &smp, &tok), 0);
    assert_int_equal(tok, top_pen);
    assert_int_not_equal(top_pen, top); /* control: the repeat's next token was the argmax */
    ref_softmax(lp, nv, NULL, 1.0, q);
    smp.temperature = 1, smp.seed = 3, smp.post = post, smp.n_post = NP;
    assert_int_equal(kvt_engine_sample(e, &smp, &tok), 0);
    const double d = check_post(post, NP, q, nv, 2e-4);
    /* the window: the last 8 tokens hold no earlier copy of the repeat */
    memset(pen, 0, sizeof *pen * (size_t) nv);
    dry_ref(t + nt - 8, 8, 2.0, 1.75, 2, pen);
    kvt_token want = 0;
    for (int32_t v = 0; v < nv; v++)
        if (l[v] - pen[v] > l[want] - pen[want]) want = v;
    smp = (struct kvt_sampling){ .top_p = 1,
                                 .dry_multiplier = 2,
                                 .dry_base = 1.75f,
                                 .dry_allowed_length = 2,
                                 .dry_penalty_last_n = 8,
                                 .history = t,
                                 .n_history = nt };
    assert_int_equal(kvt_engine_sample(e, &smp, &tok), 0);
    assert_int_equal(tok, want);
    /* a new DRY sampler (another multiplier) failing: KVT_ENOMEM, then the draw */
    smp.dry_multiplier = 3, smp.dry_penalty_last_n = W;
    kvt__fault_set(KVT__FAULT_PENALTIES, 0, 1);
    assert_int_equal(kvt_engine_sample(e, &smp, &tok), KVT_ENOMEM);
    assert_int_equal(kvt_engine_sample(e, &smp, &tok), 0);
    memset(pen, 0, sizeof *pen * (size_t) nv);
    dry_ref(t, nt, 3.0, 1.75, 2, pen);
    want = 0;
    for (int32_t v = 0; v < nv; v++)
        if ((float) (l[v] - pen[v]) > (float) (l[want] - pen[want])) want = v;
    assert_int_equal(tok, want);
    for (int32_t i = 0; i < 3; i++) { /* two settings in turn: a sampler each (the engine keeps n_seq + 4) */
        smp.dry_multiplier = 2;
        assert_int_equal(kvt_engine_sample(e, &smp, &tok), 0);
        assert_int_equal(tok, top_pen);
        smp.dry_multiplier = 3;
        assert_int_equal(kvt_engine_sample(e, &smp, &tok), 0);
        assert_int_equal(tok, want);
    }
    /* a client's breakers: "warm" ends every repeat at the history's last token (no penalty: the argmax),
    ** llama-server's default ones do not; set in turn, each gets its own sampler, also when every set hashes
    ** alike (the bytes tell them apart); the unsafe control that trusts the hash gives both one */
    static const char *const warm[] = { "warm" }, *const dflt[] = { "\n", ":", "\"", "*" };
    for (int mode = 0; mode < 3; mode++) {
        kvt_engine_test_dry_hash(e, mode);
        kvt_token got[4];
        for (int i = 0; i < 4; i++) {
            smp.dry_multiplier = 2;
            smp.dry_sequence_breakers = i % 2 ? warm : dflt;
            smp.n_dry_sequence_breakers = i % 2 ? 1 : 4;
            assert_int_equal(kvt_engine_sample(e, &smp, &got[i]), 0);
        }
        if (mode < 2) {
            assert_int_equal(got[0], top_pen);
            assert_int_equal(got[1], top);
            assert_int_equal(got[2], top_pen);
            assert_int_equal(got[3], top);
        } else {
            assert_int_equal(got[0], got[1]);
        }
    }
    kvt_engine_test_dry_hash(e, 0);
    smp.dry_sequence_breakers = NULL, smp.n_dry_sequence_breakers = 0;
    /* the engine keeps n_seq + 4 samplers (5 here), so that generations with settings of their own, drawing
    ** in turn, never remake one: five settings in turn three times make five; six (the control: more than
    ** it keeps) make one at every draw */
    assert_int_equal(dry_rounds(e, &smp, 4.0f, 5, 3), 5);
    assert_int_equal(dry_rounds(e, &smp, 10.0f, 6, 2), 12);
    smp.mirostat = 2, smp.temperature = 0; /* Mirostat's chain: no DRY; greedy */
    assert_int_equal(kvt_engine_sample(e, &smp, &tok), 0);
    assert_int_equal(tok, top);
    kvt_engine_free(e);

    /* a session's greedy reply on SmolLM2 asked to repeat a phrase: each step the argmax penalised over its
    ** stream's window */
    const struct kvt_chat_msg m[] = {
        { "user", "Repeat this line three times: the old cat sat on the warm mat. the old cat sat on the warm mat." }
    };
    struct kvt_engine_params ep = kvt_engine_default_params();
    ep.model_path = getenv("KVTIER_CHAT_MODEL");
    ep.n_ctx = 2048;
    ep.n_seq = 1;
    e = NULL;
    assert_int_equal(kvt_engine_open(&ep, &e), 0);
    kvt_engine_info(e, &I);
    kvt_session *ss = open_real_session(e, 0, KVT_POLICY_KVTIER);
    assert_int_equal(kvt_session_sync(ss, m, 1, NULL), 0);
    kvt_token *stream = NULL;
    int32_t n_stream = 0;
    assert_int_equal(kvt_chat_tokenize(e, m, 1, true, kvt_session_default_params().template_fallback, &stream, &n_stream), 0);
    stream = realloc(stream, sizeof *stream * (size_t) (n_stream + N));
    double *pt = calloc((size_t) I.n_vocab, sizeof *pt);
    assert_true(stream && pt);
    /* a breaker no token holds (the template's newlines, llama-server's default breaker, would cap the repeats) */
    static const char *const brk[] = { "\x7f\x7f" };
    smp = (struct kvt_sampling){ .top_p = 1,
                                 .dry_multiplier = 50,
                                 .dry_base = 2,
                                 .dry_allowed_length = 1,
                                 .dry_penalty_last_n = W,
                                 .dry_sequence_breakers = brk,
                                 .n_dry_sequence_breakers = 1 };
    int32_t changed = 0, steps = 0;
    for (int32_t i = 0; i < N; i++) {
        const float *ls = kvt_session_logits(ss);
        const int32_t w = n_stream < W ? n_stream : W;
        memset(pt, 0, sizeof *pt * (size_t) I.n_vocab);
        dry_ref(stream + n_stream - w, w, 50, 2, 1, pt);
        kvt_token a = 0, b = 0;
        for (int32_t v = 0; v < I.n_vocab; v++) {
            if ((float) (ls[v] - pt[v]) > (float) (ls[a] - pt[a])) a = v;
            if (ls[v] > ls[b]) b = v;
        }
        changed += a != b;
        bool done = false;
        assert_int_equal(kvt_session_gen_step(ss, &smp, &tok, &done), 0);
        assert_int_equal(tok, a);
        steps++;
        if (done) break;
        stream[n_stream++] = tok;
    }
    printf("DRY by definition: the repeat's argmax lowered (post max diff %.1e); session: %d greedy steps, DRY changed %d\n", d,
           steps, changed);
    assert_true(changed > 0);
    assert_int_equal(kvt_session_gen_end(ss, NULL), 0);
    kvt_session_free(ss);
    free(pt);
    free(stream);
    free(lp);
    free(q);
    free(pen);
    free(l);
    free(t);
    kvt_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_user_messages),
        cmocka_unit_test(test_system_after_user),
        cmocka_unit_test(test_sync),
        cmocka_unit_test(test_sessions_independent),
        cmocka_unit_test(test_batch_step),
        cmocka_unit_test(test_batch_rows),
        cmocka_unit_test(test_shared_start),
        cmocka_unit_test(test_chunked_prefill),
        cmocka_unit_test(test_prefill_stopped),
        cmocka_unit_test(test_prefill_stopped_anywhere),
        cmocka_unit_test(test_given_tokens),
        cmocka_unit_test(test_seed_own_stream),
        cmocka_unit_test(test_seed_stream_per_sequence),
        cmocka_unit_test(test_park_resume),
        cmocka_unit_test(test_real_independent),
        cmocka_unit_test(test_grammar),
        cmocka_unit_test(test_server_path),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_more_samplers),
        cmocka_unit_test(test_mirostat),
        cmocka_unit_test(test_dry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
