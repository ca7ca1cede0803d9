// Fault tests launch mpirun on this very program and watch it from outside
// (no MPI in the watching process): its combined output, its exit status,
// and whether it was still running when the time ran out (then the whole
// process group is killed).
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace halyard::testing {

struct Launch {
  std::string log;
  int rc = 0;
  double seconds = 0;
  bool hung = false;
};

// This executable's path, for mpirun to start.
inline std::string self_path() {
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  return len > 0 ? std::string(self, static_cast<size_t>(len)) : std::string();
}

// Runs args[0] with args, printing the command line; kills it after `limit_s`.
inline Launch launch(std::vector<std::string> args, double limit_s) {
  std::string line;
  for (const auto& a : args) line += a + " ";
  std::printf("$ %s\n", line.c_str());
  std::fflush(stdout);
  Launch r;
  int out[2];
  if (pipe(out) != 0) return r.rc = 127, r;
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(out[1], 1);
    dup2(out[1], 2);
    close(out[0]);
    close(out[1]);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  for (;;) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit_s) {
      r.hung = true;
      kill(-pid, SIGTERM);
      std::this_thread::sleep_for(std::chrono::seconds(3));
      kill(-pid, SIGKILL);
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;
    char buf[4096];
    const ssize_t got = read(out[0], buf, sizeof buf);
    if (got <= 0) break;
    r.log.append(buf, static_cast<size_t>(got));
  }
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::printf("%s\n--- mpirun exited %d after %.1f s\n", r.log.c_str(), r.rc, r.seconds);
  return r;
}

}  // namespace halyard::testing
