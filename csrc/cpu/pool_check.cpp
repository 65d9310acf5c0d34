// Self-check of the CPU kernels' thread pool (parallel.h), built and run by tests/test_cpu_pool.py.
//   pool_check jobs   several threads submit jobs of 1..60 tasks on 1..8 threads at once (jobs
//                     that find the pool busy run on their caller); every task must run exactly
//                     once, before its job returns. Built with -fsanitize=thread as well.
//   pool_check fork   children forked while another thread keeps the pool busy run jobs of
//                     their own (a fresh pool: no helpers, no mutex held by a parent thread).
// Exits 0 when every check passes; prints what failed otherwise.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu/parallel.h"

namespace {

// Runs `jobs` jobs of varying shape; returns how many tasks ran other than exactly once.
int run_jobs(int jobs, int seed) {
  int wrong = 0;
  for (int job = 0; job < jobs; ++job) {
    const int threads = 1 + (job + seed) % 8;
    const int64_t tasks = 1 + (job * 13 + seed) % 60;
    std::vector<int> runs(tasks, 0);
    lze_cpu::parallel_tasks(tasks, threads, [&](int64_t task) { ++runs[task]; });
    for (const int r : runs) wrong += r != 1;
  }
  return wrong;
}

int check_jobs() {
  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int caller = 0; caller < 3; ++caller) {
    callers.emplace_back([&wrong, caller] { wrong += run_jobs(400, caller); });
  }
  for (auto& caller : callers) caller.join();
  if (wrong != 0) std::printf("jobs: %d tasks did not run exactly once\n", wrong.load());
  return wrong == 0 ? 0 : 1;
}

int check_fork() {
  std::atomic<bool> stop{false};
  std::thread background([&stop] {
    while (!stop) run_jobs(1, 3);
  });
  int failed = 0;
  for (int child = 0; child < 100; ++child) {
    const pid_t pid = fork();
    if (pid == 0) _exit(run_jobs(20, child) == 0 ? 0 : 1);
    int status = 0;
    int waited_ms = 0;
    while (waitpid(pid, &status, WNOHANG) == 0 && waited_ms < 10000) {
      usleep(1000);
      ++waited_ms;
    }
    if (waited_ms >= 10000) {  // a child stuck on a mutex the parent held
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      ++failed;
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ++failed;
    }
  }
  stop = true;
  background.join();
  if (failed != 0) std::printf("fork: %d of 100 children failed or hung\n", failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "jobs") == 0) return check_jobs();
  if (argc == 2 && std::strcmp(argv[1], "fork") == 0) return check_fork();
  std::printf("usage: %s jobs|fork\n", argv[0]);
  return 2;
}
