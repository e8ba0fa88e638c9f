// Wire formats: the control messages between devices and the region descriptor. Little-endian
// host order (both ends run this code); every read is bounds-checked and throws Invalid.
//
// Handshake (handshake.cpp): frames on the device's own tcp listener, each
// magic u32 (kHandshakeMagic), type u32, payload length u32, payload:
//   HELLO(version u32, nonce_c[16], uuid_c u64, endpoint str)     connector -> acceptor
//   CHALLENGE(nonce_s[16], uuid_s u64)                            acceptor -> connector
//   AUTH(token_c u64, worker 0 address str, mac_c[32])            connector -> acceptor
//   WELCOME(token_s u64, n u32, n x worker address str, mac_s[32]) acceptor -> connector
//   REJECT(reason, raw bytes; kSecretMismatch for a wrong secret)  acceptor -> connector
// mac_x = HMAC-SHA256(secret, label_x || nonce_c || nonce_s || uuid_c || uuid_s || the message
// before the mac). The acceptor's first keyed byte follows the connector's proof.
// Control message: one UCP active message (id kAmId) on the control link, header CtrlHeader
// (its `link` the receiver's token from the handshake: a message naming no link is dropped),
// payload by type:
//   REJECT(reason, raw bytes)                                    either way
//   LOOKUP(name str, claim u32, expected value str) / LOOKUP_REPLY(ok u32, value str, or why not)
//   VALIDATE(region u64, addr u64, len u64) / VALIDATE_REPLY(ok u32, reason str)
//   REVOKE(region u64) / REVOKE_ACK()                            owner -> holder -> owner
//   OPEN_CHANNEL(qp u32, worker address str) / OPEN_CHANNEL_REPLY(ok u32, reason str)
// Flagged write: one UCP active message (id kFlaggedAmId), header FlaggedHeader, payload the
// data (flagged.cpp).
// Descriptor: see docs/architecture.md ("Descriptors"); the MAC covers everything before it.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "hmac_sha256.hpp"
#include "rdmaflow.hpp"

namespace rdmaflow {

constexpr uint16_t kAmId = 0x5246;  // "RF"
constexpr uint32_t kCtrlMagic = 0x52464331;  // "RFC1"
constexpr uint32_t kProtoVersion = 4;  // 2: OPEN_CHANNEL; 3: LOOKUP's claim; 4: tcp handshake
constexpr uint32_t kHandshakeMagic = 0x31484652;  // "RFH1"
// The largest handshake payload an acceptor reads (a HELLO or an AUTH, with a worker address).
constexpr size_t kMaxHandshakeFrame = 16 << 10;
// REJECT's reason for a wrong secret: a fixed text, the same whatever the acceptor's secret.
constexpr char kSecretMismatch[] = "job secret mismatch";
constexpr char kDescMagic[4] = {'R', 'F', 'D', '1'};
constexpr size_t kMacLen = 16;
constexpr uint16_t kDescShared = 1;  // descriptor flag: same-host mapping block follows the rkey
constexpr uint16_t kDescCuda = 2;    // descriptor flag: GPU memory; the CUDA ordinal follows last
constexpr size_t kMaxCtrlPayload = 1 << 20;

constexpr uint16_t kFlaggedAmId = 0x5247;  // "RG"
// The data one flagged write's message carries at most; larger flagged writes take the put path.
constexpr size_t kFlaggedMaxBytes = size_t(512) << 10;
// UCX tcp segment, both ways, that holds one message and its headers (8 KiB to spare): UCX
// sends an eager message of more than a segment as fragments that its receiver puts together
// with a copy.
constexpr size_t kFlaggedSegBytes = kFlaggedMaxBytes + (size_t(8) << 10);
constexpr uint64_t kFlaggedMagic = 0x34574752;  // "RGW4"
// A flagged write's message header: the payload goes to [data_off, data_off + payload length) of
// the target's region; then the target stores `value` to the 8-byte word at word_off; just
// before it, the rider (when rider_region_id is not 0): rider_value to the word at rider_off of
// that region.
struct FlaggedHeader {
  uint64_t magic;
  uint64_t region_id;
  uint64_t region_addr;  // the region's address as its descriptor gave it: a stale id misses
  uint64_t data_off;
  uint64_t word_off;
  uint64_t value;
  uint64_t rider_region_id;  // 0: no rider (region ids start at 1)
  uint64_t rider_region_addr;
  uint64_t rider_off;
  uint64_t rider_value;
};
// The segment's spare bytes hold this header and UCX's (its tcp and active-message headers,
// well under 256 bytes).
static_assert(kFlaggedSegBytes - kFlaggedMaxBytes >= sizeof(FlaggedHeader) + 256,
              "a flagged message and its headers must fit one tcp segment");

enum CtrlType : uint32_t {
  HELLO = 1,
  CHALLENGE,
  AUTH,
  WELCOME,
  REJECT,
  LOOKUP,
  LOOKUP_REPLY,
  VALIDATE,
  VALIDATE_REPLY,
  REVOKE,
  REVOKE_ACK,
  OPEN_CHANNEL,
  OPEN_CHANNEL_REPLY,
};

struct CtrlHeader {
  uint32_t magic;
  uint32_t type;
  uint64_t req;
  uint64_t link;  // the receiving link's token
};

struct Writer {
  std::string s;
  void u16(uint16_t v) { s.append(reinterpret_cast<const char*>(&v), 2); }
  void u32(uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
  void u64(uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
  void raw(const void* p, size_t n) { s.append(static_cast<const char*>(p), n); }
  void str(const std::string& v) {
    u32(uint32_t(v.size()));
    s += v;
  }
};

struct Reader {
  const std::string& s;
  size_t pos = 0;
  const char* what;
  Reader(const std::string& str, const char* w) : s(str), what(w) {}
  void need(size_t n) {
    if (n > s.size() - pos)
      throw Error(ErrorKind::Invalid, std::string("malformed ") + what + ": truncated at byte " +
                                          std::to_string(pos) + " of " + std::to_string(s.size()));
  }
  template <class T>
  T num() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, s.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  void raw(void* out, size_t n) {
    need(n);
    std::memcpy(out, s.data() + pos, n);
    pos += n;
  }
  std::string str(size_t max_len = kMaxCtrlPayload) {
    uint32_t n = num<uint32_t>();
    if (n > max_len)
      throw Error(ErrorKind::Invalid, std::string("malformed ") + what + ": field of " +
                                          std::to_string(n) + " bytes is too long");
    need(n);
    std::string v = s.substr(pos, n);
    pos += n;
    return v;
  }
  void end() {
    if (pos != s.size())
      throw Error(ErrorKind::Invalid, std::string("malformed ") + what + ": " +
                                          std::to_string(s.size() - pos) + " trailing bytes");
  }
};

// The descriptor MAC: the first kMacLen bytes of HMAC-SHA256(secret, body).
inline std::string mac16(const std::string& key, const std::string& body) {
  auto d = hmac_sha256(key, body.data(), body.size());
  return std::string(reinterpret_cast<const char*>(d.data()), kMacLen);
}

// HMAC-SHA256(secret, label || transcript || body): each side's proof in the handshake.
inline std::string handshake_mac(const std::string& key, const char* label,
                                 const std::string& transcript, const std::string& body) {
  std::string m(label);
  m += transcript;
  m += body;
  auto d = hmac_sha256(key, m.data(), m.size());
  return std::string(reinterpret_cast<const char*>(d.data()), 32);
}

}  // namespace rdmaflow
