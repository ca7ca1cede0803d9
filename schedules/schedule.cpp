// Schedule presets, JSON form and validation (see schedule.h).
#include "schedules/schedule.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsl/error.h"
#include "dsl/types.h"
#include "schedules/tiling.h"

namespace halyard {
namespace {

const std::set<std::string>& recomputable() {
  static const std::set<std::string> ops = {"rms_norm", "rope", "silu", "mul"};
  return ops;
}

}  // namespace

std::string Schedule::to_json() const {
  nlohmann::json j = {{"name", name}, {"recompute", recompute}, {"autoscheduler", autoscheduler}, {"checkpoint", checkpoint}};
  if (!split_sequence.empty()) j["split_sequence"] = split_sequence;
  if (!redistribute_heads.empty()) j["redistribute_heads"] = redistribute_heads;
  if (seq_tile > 0) j["seq_tile"] = seq_tile;
  return j.dump(2);
}

std::function<bool(const Node&)> Schedule::rematerialize() const {
  if (!checkpoint && seq_tile <= 0) return {};
  const bool tiled = seq_tile > 0, all = checkpoint;
  return [tiled, all](const Node& n) {
    // Tiles of wide values are recomputed per tile in the backward, so that
    // the tiles of one value never all live at once; slices cost nothing.
    if (tiled && (is_wide(n) || n.op == Op::SliceSeq)) return true;
    if (!all) return false;
    switch (n.op) {
      case Op::Add:         // the residual stream: each layer's input
      case Op::Embedding:
      case Op::Attention:   // expensive, and its output is what the backward reads
      case Op::TokenCount:
        return false;
      case Op::SeqToHeads:  // collectives are saved: redoing one costs a network round
      case Op::HeadsToSeq:
      case Op::GatherSeq:
      case Op::AllReduce:
      case Op::ConcatSeq:
        return false;
      default:
        return true;
    }
  };
}

std::string Schedule::str() const {
  std::string s = "schedule " + name + ": recompute {" +
                  join(std::vector<std::string>(recompute.begin(), recompute.end())) + "}";
  if (checkpoint) s += ", checkpointed (backward recomputes all but residuals and attention)";
  s += autoscheduler.empty() ? ", hand-written loop schedules" : ", autoscheduler " + autoscheduler;
  if (!split_sequence.empty()) s += ", split_sequence(" + split_sequence + "), redistribute_heads(" + redistribute_heads + ")";
  if (seq_tile > 0) s += ", tile_sequence(" + std::to_string(seq_tile) + ")";
  return s;
}

Schedule Schedule::parse(const std::string& text, const std::string& what) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw UserError("error: schedule \"" + what + "\" is not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw UserError("error: schedule \"" + what + "\" must be a JSON object.");
  Schedule s;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (key == "name" && it->is_string()) {
      s.name = it->get<std::string>();
    } else if (key == "recompute" && it->is_array()) {
      for (const auto& op : *it) {
        std::string o = op.is_string() ? op.get<std::string>() : op.dump();
        if (!recomputable().count(o))
          throw UserError("error: schedule \"" + what + "\": recompute(" + o +
                          ")\nonly cheap ops can be recomputed in the backward.\nlegal: " +
                          join(std::vector<std::string>(recomputable().begin(), recomputable().end())) + ".");
        s.recompute.insert(o);
      }
    } else if (key == "checkpoint" && it->is_boolean()) {
      s.checkpoint = it->get<bool>();
    } else if (key == "split_sequence" && it->is_string()) {
      s.split_sequence = it->get<std::string>();
      if (!s.split_sequence.empty() && s.split_sequence != "sp")
        throw UserError("error: schedule \"" + what + "\": split_sequence(\"" + s.split_sequence +
                        "\")\nthe sequence is split over the mesh axis sp.\nlegal: \"sp\", or \"\" for no split.");
    } else if (key == "redistribute_heads" && it->is_string()) {
      s.redistribute_heads = it->get<std::string>();
      if (s.redistribute_heads == "ring" || s.redistribute_heads == "hybrid")
        throw UserError("error: schedule \"" + what + "\": redistribute_heads(" + s.redistribute_heads +
                        ") is not implemented yet.\nlegal: \"ulysses\" (all-to-all of heads).");
      if (!s.redistribute_heads.empty() && s.redistribute_heads != "ulysses")
        throw UserError("error: schedule \"" + what + "\": redistribute_heads(\"" + s.redistribute_heads +
                        "\") is not a strategy.\nlegal: \"ulysses\".");
    } else if (key == "seq_tile" && it->is_number_integer()) {
      s.seq_tile = it->get<int64_t>();
      if (s.seq_tile < 0)
        throw UserError("error: schedule \"" + what + "\": seq_tile " + std::to_string(s.seq_tile) +
                        "\nlegal: tokens per tile of the MLP and loss (e.g. 1024), or 0 for none.");
    } else if (key == "autoscheduler" && it->is_string()) {
      s.autoscheduler = it->get<std::string>();
      if (!s.autoscheduler.empty() && s.autoscheduler != "Adams2019")
        throw UserError("error: schedule \"" + what + "\": autoscheduler \"" + s.autoscheduler +
                        "\" is not supported.\nlegal: \"\" (hand-written schedules) or \"Adams2019\".");
    } else {
      throw UserError("error: schedule \"" + what + "\": unknown or ill-typed key \"" + key + "\" (" +
                      it->dump() + ").\nlegal keys: name (string), recompute (array of op names), "
                      "checkpoint (bool), autoscheduler (string), split_sequence (\"sp\"), "
                      "redistribute_heads (\"ulysses\"), seq_tile (integer).");
    }
  }
  if (s.split_sequence.empty() != s.redistribute_heads.empty())
    throw UserError("error: schedule \"" + what + "\": split_sequence(\"" + s.split_sequence +
                    "\") with redistribute_heads(\"" + s.redistribute_heads +
                    "\")\nattention needs every key: a split sequence needs a head redistribution, and "
                    "redistributing heads needs a split sequence.\nlegal: both (\"sp\", \"ulysses\") or neither.");
  return s;
}

Schedule Schedule::named(const std::string& n) {
  Schedule s;
  s.name = n;
  if (n == "default") return s;
  if (n == "recompute") {
    s.recompute = recomputable();
    return s;
  }
  if (n == "checkpoint") {
    s.recompute = recomputable();
    s.checkpoint = true;
    return s;
  }
  if (n == "autoscheduled") {
    s.autoscheduler = "Adams2019";
    return s;
  }
  if (n == "tiled") {
    s.recompute = recomputable();
    s.seq_tile = 1024;
    return s;
  }
  if (n == "ulysses" || n == "ulysses_checkpoint") {
    s.split_sequence = "sp";
    s.redistribute_heads = "ulysses";
    if (n == "ulysses_checkpoint") {
      s.recompute = recomputable();
      s.checkpoint = true;
    }
    return s;
  }
  std::ifstream in(n);
  if (!in)
    throw UserError("error: schedule \"" + n + "\" is neither a preset nor a readable file.\n"
                    "legal: default, recompute, checkpoint, autoscheduled, tiled, ulysses, ulysses_checkpoint,\n"
                    "or a path to a schedule .json.");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), n);
}

}  // namespace halyard
