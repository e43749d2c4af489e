/* cmd_demo.c — `kvtier demo`: the planted-fact session.
**
** Turn 1 plants a fact, a dozen unrelated general-knowledge questions push the session far
** past its token budget (so the fact's block is evicted), and the last turn asks for the fact.
** Just before the probe's reply is generated, the teacher-forced log-probability of the
** expected answer is read (kvt_session_answer_logprob), which compares recovery modes without
** depending on what greedy decoding happens to say.  Ends with one JSON line on stdout.
** Greedy decoding by default, so a run is deterministic for a given model and build.
** Two conversations: the replayed one below for a base model (Gemma 3 270M, the default), and
** with --live a shorter one for an instruction-tuned model (SmolLM2-135M-Instruct) whose every
** reply is generated (LIVE_TEXT). */
#include "cli.h"
#include "model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The fact sits in the middle of a long first message: past the first block (the attention
** sink, never evicted at the default block size of 64) and with user text on both sides, so the
** block that holds it reads as a piece of that message wherever it is loaded back. */
static const char FACT_TURN[] =
    "Hello! Today I would like to ask you a long series of general-knowledge questions about science, "
    "history, geography and everyday technology, so please keep your answers short and friendly. I am "
    "preparing for a pub quiz with my friends next weekend, and we always lose the science round, so this "
    "practice really matters to me. Before we start, please remember this: my favourite number is 4242. "
    "I will ask you about it again at the very end, so keep it in mind. To give you an idea of my level, I "
    "studied biology at school, I read a lot of popular history books, and I enjoy documentaries about "
    "space, volcanoes and the oceans, but I have never been good at remembering dates and names.";
static const char FACT_REPLY[] = "Okay, I will keep that in mind. Ask me anything you like.";
static const char FACT_VALUE[] = "4242";
static const char PROBE[] = "Do you remember my favourite number? What is it?";
static const char ANSWER[] = "Your favourite number is 4242.";

/* Unrelated questions, each with the answer the replayed conversation gives (Gemma 3 270M is a
** base model: left to answer by itself it copies its earlier replies, so by default the demo
** replays these and generates only the probe's reply; --live generates every reply).  None of
** them shares a content word with the probe, so BM25 does not pull them back for it. */
static const char *const QA[][2] = {
    { "I have been reading about astronomy lately. Can you explain in simple terms why the sky looks blue "
      "during the day but turns red and orange around sunset, and what role the atmosphere plays in that?",
      "Sunlight is scattered by the molecules of the air, and blue light is scattered much more strongly than "
      "red light, so the whole sky glows blue. At sunset the light crosses far more air, the blue is scattered "
      "away, and the reds and oranges are what reach your eyes." },
    { "My cousin is studying ancient history. Who was Julius Caesar, what was he famous for in the Roman "
      "Republic, and why is the phrase 'crossing the Rubicon' still used today?",
      "Julius Caesar was a Roman general and statesman who conquered Gaul and became dictator of Rome. In 49 BC "
      "he led his army across the Rubicon river into Italy, which was forbidden and started a civil war, so the "
      "phrase now means passing a point of no return." },
    { "How do volcanoes form, and what is the difference between the volcanoes of Hawaii and the ones around "
      "the Pacific Ring of Fire, such as Mount Fuji or Mount St. Helens?",
      "Volcanoes form where molten rock from the mantle reaches the surface. Hawaii sits above a hot spot and "
      "erupts runny basalt that builds broad shield volcanoes, while the Ring of Fire volcanoes sit above "
      "subduction zones and erupt sticky, gas-rich magma explosively." },
    { "Could you describe how photosynthesis works in green plants, including what happens to sunlight, "
      "water and carbon dioxide inside the leaves?",
      "Chlorophyll in the leaves absorbs sunlight and uses its energy to split water, releasing oxygen. The "
      "energy captured this way is then used to turn carbon dioxide from the air into sugars, which the plant "
      "uses to grow and to store energy." },
    { "What were the main causes of the First World War, and how did the assassination of Archduke Franz "
      "Ferdinand in Sarajevo lead to a much wider conflict across Europe?",
      "Rival alliances, an arms race, nationalism and competition for empire had made Europe tense. When a "
      "Serbian nationalist shot the Archduke in 1914, Austria-Hungary declared war on Serbia, and the alliance "
      "system quickly pulled in Russia, Germany, France and Britain." },
    { "Explain how a refrigerator keeps food cold. What does the compressor do, and why does the back of the "
      "fridge feel warm when you touch it?",
      "A refrigerant evaporates inside the fridge and absorbs heat from the food. The compressor squeezes the "
      "warm vapour to a high pressure and pushes it through the coils at the back, where it releases that "
      "heat into the room, which is why they feel warm." },
    { "I am planning a trip to Japan in the spring. When is the cherry blossom season, and which cities or "
      "parks are famous for viewing the blossoms?",
      "The blossoms usually open from late March to early April, a little later in the north. Popular places "
      "are Ueno Park and the Meguro River in Tokyo, the Philosopher's Path and Maruyama Park in Kyoto, and the "
      "castle grounds of Hirosaki." },
    { "What is the difference between weather and climate, and why do scientists say that one cold winter "
      "does not disprove global warming?",
      "Weather is what the atmosphere does over hours and days, while climate is the average pattern over "
      "decades. A single cold winter is one local weather event, and the warming trend only shows up in "
      "long-term averages over the whole planet." },
    { "Tell me about the Great Wall of China: when was it built, who built it, and was it really effective at "
      "keeping invaders out of the empire?",
      "The wall was built in many stages over two thousand years, most of what stands today by the Ming "
      "dynasty. Soldiers, peasants and prisoners built it. It slowed raids and helped control trade, but "
      "determined armies, such as the Manchus, still got through." },
    { "How does the human heart pump blood around the body? Please describe the four chambers and the path "
      "that blood takes through the lungs.",
      "The heart has two atria on top and two ventricles below. Blood from the body enters the right atrium, "
      "the right ventricle pumps it to the lungs to pick up oxygen, it returns to the left atrium, and the "
      "strong left ventricle pumps it out to the body." },
    { "Why do we have seasons on Earth? Is it because the Earth is closer to the Sun in summer, or is there "
      "another explanation involving the tilt of its axis?",
      "Seasons come from the tilt of the Earth's axis, about 23.5 degrees. When your hemisphere leans towards "
      "the Sun, sunlight arrives more directly and days are longer, so it is summer. The distance to the Sun "
      "changes very little and is not the cause." },
    { "Who painted the Mona Lisa, and why is the painting in the Louvre museum in Paris considered so famous "
      "and valuable compared with other portraits of its time?",
      "Leonardo da Vinci painted it in the early sixteenth century. It is admired for the soft shading called "
      "sfumato and the mysterious smile, and its fame grew enormously after it was stolen from the Louvre in "
      "1911 and recovered two years later." },
    { "Can you explain how vaccines train the immune system to recognise a virus, and why some vaccines need "
      "booster shots after a few years?",
      "A vaccine shows the immune system a harmless piece or weakened form of the virus, so it makes "
      "antibodies and memory cells without getting sick. Over time that memory can fade or the virus can "
      "change, so a booster reminds the body what to look for." },
    { "What causes earthquakes, and how do seismologists measure how strong they are using scales such as the "
      "moment magnitude scale?",
      "Earthquakes happen when stress builds up along faults in the crust and the rocks suddenly slip. "
      "Seismometers record the waves, and the moment magnitude scale estimates the energy released from the "
      "fault area and slip; each step up means about 32 times more energy." },
};
#define N_QUESTIONS ((int) (sizeof QA / sizeof QA[0]))

/* --live: the conversation for an instruction-tuned chat model (SmolLM2-135M-Instruct), every
** reply generated.  LIVE_TEXT[0] states the fact once and asks the model to repeat it, a dozen
** quick unrelated questions follow, and the probe asks the same question again.  Why this shape
** (measured with --budget 0, docs/EVALUATION.md): a 135M model does not pull a number out of
** ~500 tokens of unrelated chat when asked in other words, and after long replies it copies the
** latest one; it does answer a question it has seen before by copying its earlier answer, which
** it can only do while that turn's KV is in the cache.  The questions ask for one word, so the
** replies stay short; none shares a content word with the probe.  The fact sits in the chat's
** first tokens, so --live uses blocks of 8 tokens: only the first block (the attention sink,
** "My favourite number is ") is never evicted, the value itself can be. */
static const char LIVE_FACT_VALUE[] = "4242";
static const char *const LIVE_TEXT[] = {
    "My favourite number is 4242. Can you repeat my favourite number back to me?",
    "Answer in one word: what is the capital city of France?",
    "Answer in one word: which planet is known as the Red Planet?",
    "Answer in one word: what gas do plants absorb from the air?",
    "Answer in one word: which ocean lies between Africa and Australia?",
    "Answer in one word: who wrote the play Romeo and Juliet?",
    "Answer in one word: what is the largest mammal on Earth?",
    "Answer in one word: which metal is liquid at room temperature?",
    "Answer in one word: what is the hardest natural substance?",
    "Answer in one word: which country has the city of Kyoto?",
    "Answer in one word: what is the chemical symbol for gold?",
    "Answer in one word: which instrument has eighty-eight keys?",
    "Answer in one word: what is the longest river in Africa?",
    "Can you repeat my favourite number back to me?",
};
#define N_LIVE ((int) (sizeof LIVE_TEXT / sizeof LIVE_TEXT[0]))
static const char LIVE_ANSWER[] = "Your favourite number is 4242.";

static void demo_usage(FILE *f, const struct cli_opt *opts) {
    fprintf(f,
            "Usage: kvtier demo [-m MODEL] [options]\n"
            "\n"
            "The planted-fact session: turn 1 plants a fact (\"my favourite number is %s\"), %d unrelated\n"
            "questions push the conversation past the token budget so the fact's block is evicted, and\n"
            "the last turn asks for it. Prints each turn and its status (stderr), then ONE JSON line on\n"
            "stdout: recalled, evictions, recoveries, peak_resident_tokens, budget, recovery, answer,\n"
            "answer_logprob (teacher-forced log-probability of \"%s\" before the reply), ...\n"
            "The questions' answers are replayed (Gemma 3 270M is a base model and copies its own\n"
            "earlier replies); only the probe's reply is generated, greedily, and cut at its first line\n"
            "break. --live runs a conversation for an instruction-tuned model (SmolLM2-135M-Instruct,\n"
            "$KVTIER_CHAT_MODEL) and generates every reply: the fact with a request to repeat it, %d\n"
            "one-word quiz questions, and the same request again as the probe.\n"
            "MODEL defaults to $KVTIER_MODEL; --max-tokens defaults to 48 here (24 per reply with\n"
            "--live), --block to 64 (8 with --live). --budget 0 runs without eviction (the reference).\n"
            "\n"
            "Options:\n",
            FACT_VALUE, N_QUESTIONS, ANSWER, N_LIVE - 2);
    cli_print_opts(f, opts);
}

struct fact_state {
    int n_blocks;     /* blocks holding any byte of the fact's value */
    bool resident;    /* all of them on the device */
    int n_evictions;  /* evictions those blocks went through */
    int n_recoveries; /* and loads back (kv_restore) */
    int first_block;  /* id of the first, -1 if the value was not found */
};

/* Find the blocks holding the fact's value: its first occurrence in the concatenated block
** texts (blocks in creation order = conversation order), so a value split across two blocks
** counts both.  Texts are copied at once: the session owns them only until the next call. */
static int find_fact(struct cli_session *cs, const char *value, struct fact_state *fs) {
    int32_t n = kvt_session_n_blocks(cs->s);
    size_t len = 0, cap = 1024;
    char *all = malloc(cap);
    size_t *start = calloc((size_t) n + 1, sizeof *start);
    memset(fs, 0, sizeof *fs);
    fs->first_block = -1;
    fs->resident = false;
    if (!all || !start) {
        free(all);
        free(start);
        return APP_ERR;
    }
    for (int32_t i = 0; i < n; i++) {
        struct kvt_block_info b;
        start[i] = len;
        if (kvt_session_block(cs->s, i, &b) || !b.text) continue;
        size_t m = strlen(b.text);
        if (len + m + 1 > cap) {
            while (len + m + 1 > cap) cap *= 2;
            char *na = realloc(all, cap);
            if (!na) {
                free(all);
                free(start);
                return APP_ERR;
            }
            all = na;
        }
        memcpy(all + len, b.text, m);
        len += m;
    }
    start[n] = len;
    all[len] = '\0';
    const char *hit = strstr(all, value);
    if (hit) {
        size_t a = (size_t) (hit - all), z = a + strlen(value);
        fs->resident = true;
        for (int32_t i = 0; i < n; i++) {
            if (start[i + 1] <= a || start[i] >= z) continue;
            struct kvt_block_info b;
            if (kvt_session_block(cs->s, i, &b)) continue;
            if (fs->first_block < 0) fs->first_block = b.id;
            fs->n_blocks++;
            fs->n_evictions += b.n_evictions;
            fs->n_recoveries += b.n_recoveries;
            if (b.residency != KVT_RES_DEVICE) fs->resident = false;
        }
    }
    free(all);
    free(start);
    return APP_OK;
}

int cmd_demo(int argc, char **argv) {
    static const char cmd[] = "kvtier demo";
    struct cli_run_opts o;
    bool json_only = false, live = false;
    cli_run_opts_default(&o);
    o.max_tokens = 0; /* resolved below: 48 for the replayed probe, 24 per live reply */
    o.block = 0;      /* resolved below: 64, or 8 with --live (the fact sits in the chat's first tokens) */
    /* clang-format off: one row per option, laid out by hand */
    const struct cli_opt opts[] = {
        CLI_RUN_OPT_ROWS(&o),
        { "json-only", 0, OPT_FLAG, &json_only, 0, 0, NULL,
          "print only the final JSON line on stdout (turn status lines still go to stderr)", NULL },
        { "live", 0, OPT_FLAG, &live, 0, 0, NULL,
          "generate every reply instead of replaying the scripted answers (instruction-tuned models)", NULL },
        { NULL, 0, 0, NULL, 0, 0, NULL, NULL, NULL },
    };
    /* clang-format on */
    int n_pos;
    int rc = cli_parse(cmd, opts, argc, argv, NULL, 0, &n_pos);
    if (rc < 0) {
        demo_usage(stdout, opts);
        return APP_OK;
    }
    if (rc) return rc;
    if (!o.max_tokens) o.max_tokens = live ? 24 : 48;
    if (!o.block) o.block = live ? 8 : 64;
    if (!o.store) o.no_store = true; /* the demo compares recovery modes from a cold start: a store only when named */
    if (!(o.model = cli_model_path(cmd, o.model, NULL))) return APP_USAGE;
    if ((rc = cli_run_opts_check(cmd, &o))) return rc;

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    struct cli_session cs;
    if ((rc = cli_session_open(cmd, &o, &cs))) return rc;
    /* the conversation: replayed (base model) or live (instruction-tuned model) */
    const int n_turns = live ? N_LIVE : N_QUESTIONS + 2;
    const char *value = live ? LIVE_FACT_VALUE : FACT_VALUE, *expected = live ? LIVE_ANSWER : ANSWER;
    const char *probe = live ? LIVE_TEXT[N_LIVE - 1] : PROBE;
    fprintf(stderr, "%s: %s | budget %d%s | block %d | recovery %s | %d turns, %s\n", cmd, cs.info.desc, cs.budget,
            o.budget ? "" : " (no eviction)", o.block, o.recovery, n_turns,
            live ? "every reply generated (--live)" : "replies replayed, the probe's generated");

    struct kvt_session_stats st;
    char *reply = NULL;
    struct fact_state fs = { 0, false, 0, 0, -1 };
    double lp = 0;
    int32_t n_lp = 0;
    const bool stream = !json_only;

    /* plant, distract */
    for (int t = 0; t < n_turns - 1 && rc == APP_OK; t++) {
        const char *user = live ? LIVE_TEXT[t] : t == 0 ? FACT_TURN : QA[t - 1][0];
        if (stream) printf("> %s\n", user);
        if (live) {
            rc = cli_turn(cmd, &cs, &o, user, stream, false, &reply);
            free(reply);
            reply = NULL;
        } else {
            rc = cli_turn_scripted(cmd, &cs, &o, user, t == 0 ? FACT_REPLY : QA[t - 1][1], stream, false);
        }
    }
    /* probe: look at the block table and score the expected answer between add and generate */
    if (rc == APP_OK) {
        if (stream) printf("> %s\n", probe);
        rc = cli_turn_begin(cmd, &cs, probe);
    }
    if (rc == APP_OK && (rc = find_fact(&cs, value, &fs))) fprintf(stderr, "%s: out of memory reading the block table\n", cmd);
    if (rc == APP_OK) {
        int lrc = kvt_session_answer_logprob(cs.s, expected, &lp, &n_lp);
        if (lrc) {
            app_fail(cmd, "answer log-probability", lrc);
            rc = APP_ERR;
        }
    }
    cs.stop_at_newline = !live; /* the answer is one line; a base model would ramble on */
    if (rc == APP_OK) rc = cli_turn_end(cmd, &cs, &o, stream, false, &reply);
    if (rc) {
        cli_session_close(&cs);
        return rc;
    }
    if (fs.first_block < 0) fprintf(stderr, "%s: warning: no block holds \"%s\" any more\n", cmd, value);
    clock_gettime(CLOCK_MONOTONIC, &t1);

    kvt_session_get_stats(cs.s, &st);
    char llama[512], *answer = app_utf8_clean(reply);
    app_build_llama(llama, sizeof llama);
    json_t *obj = answer ? json_pack("{s:b, s:I, s:I, s:i, s:i, s:s, s:s, s:f, s:i, s:b, s:i, s:s, s:s,"
                                     " s:s, s:s, s:i, s:i, s:i, s:i, s:b, s:i, s:I, s:I, s:f}",
                                     "recalled", strstr(reply, value) != NULL, "evictions", (json_int_t) st.evictions, "recoveries",
                                     (json_int_t) st.recoveries, "peak_resident_tokens", st.peak_resident_tokens, "budget",
                                     cs.budget, "recovery", o.recovery, "answer", answer, "answer_logprob", lp, "answer_tokens",
                                     n_lp, "fact_block_resident_at_probe", fs.resident, "turns", cs.n_turns, "model", cs.info.desc,
                                     "llama_cpp", llama, "probe", probe, "expected", expected, "fact_block", fs.first_block,
                                     "fact_block_evictions", fs.n_evictions, "fact_block_recoveries", fs.n_recoveries, "block",
                                     o.block, "live", live, "total_tokens", st.total_tokens, "tokens_decoded",
                                     (json_int_t) st.tokens_decoded, "tokens_recovered", (json_int_t) st.tokens_recovered,
                                     "seconds", (double) (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9)
                         : NULL;
    free(answer);
    free(reply);
    cli_session_close(&cs);
    return app_json_line(cmd, obj);
}
