// FutureState: the completion of one memcpy or flush, shared by the issuer and the progress
// thread that completes it; FutureJoin: one future for several.
#include "internal.hpp"

namespace rdmaflow {

bool FutureState::wait(double timeout_s) {
  if (done()) return true;
  ProgressThread::Relying relying;
  std::unique_lock<std::mutex> lk(m_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return done(); });
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done(); });
}

void FutureState::finish(int s) {
  {
    std::lock_guard<std::mutex> lk(m_);
    state_.store(s, std::memory_order_release);
  }
  cv_.notify_all();
  if (on_complete) {
    auto cb = std::move(on_complete);
    on_complete = nullptr;
    cb(shared_from_this());
  }
}

void FutureState::complete_ok() { finish(1); }

void FutureState::complete_error(ErrorKind k, const std::string& msg) {
  kind_ = k;
  msg_ = msg;
  finish(2);
}

bool FutureJoin::part_done(const Future& f) {
  if (!f->ok()) {
    std::lock_guard<std::mutex> lk(m_);
    if (error_.empty()) {
      kind_ = f->error_kind();
      error_ = f->error();
    }
  }
  if (left_.fetch_sub(1, std::memory_order_acq_rel) != 1) return false;
  std::unique_lock<std::mutex> lk(m_);  // the last part: every error is counted in
  if (error_.empty()) {
    lk.unlock();
    fut_->complete_ok();
  } else {
    const ErrorKind kind = kind_;
    const std::string error = error_;
    lk.unlock();
    fut_->complete_error(kind, error);
  }
  return true;
}

}  // namespace rdmaflow
