// Schedule presets, JSON form and validation (see schedule.h).
#include "schedules/schedule.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsl/error.h"
#include "dsl/types.h"

namespace halyard {
namespace {

const std::set<std::string>& recomputable() {
  static const std::set<std::string> ops = {"rms_norm", "rope", "silu", "mul"};
  return ops;
}

}  // namespace

std::string Schedule::to_json() const {
  nlohmann::json j = {{"name", name}, {"recompute", recompute}, {"autoscheduler", autoscheduler}, {"checkpoint", checkpoint}};
  return j.dump(2);
}

std::function<bool(const Node&)> Schedule::rematerialize() const {
  if (!checkpoint) return {};
  return [](const Node& n) {
    switch (n.op) {
      case Op::Add:         // the residual stream: each layer's input
      case Op::Embedding:
      case Op::Attention:   // expensive, and its output is what the backward reads
      case Op::TokenCount:
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
    } else if (key == "autoscheduler" && it->is_string()) {
      s.autoscheduler = it->get<std::string>();
      if (!s.autoscheduler.empty() && s.autoscheduler != "Adams2019")
        throw UserError("error: schedule \"" + what + "\": autoscheduler \"" + s.autoscheduler +
                        "\" is not supported.\nlegal: \"\" (hand-written schedules) or \"Adams2019\".");
    } else {
      throw UserError("error: schedule \"" + what + "\": unknown or ill-typed key \"" + key + "\" (" +
                      it->dump() + ").\nlegal keys: name (string), recompute (array of op names), "
                      "checkpoint (bool), autoscheduler (string).");
    }
  }
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
  std::ifstream in(n);
  if (!in)
    throw UserError("error: schedule \"" + n + "\" is neither a preset nor a readable file.\n"
                    "legal: default, recompute, checkpoint, autoscheduled, or a path to a schedule .json.");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse(ss.str(), n);
}

}  // namespace halyard
