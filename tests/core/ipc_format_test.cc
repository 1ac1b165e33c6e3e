// torch's CUDA IPC handle bytes (core/ipc_format.h): the layout torch reads, and every malformed
// input refused with a message naming what is wrong.
#include "core/ipc_format.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace vramledger::core {
namespace {

using ::testing::HasSubstr;

IpcHandle Pages(int pid, std::size_t page_size, std::vector<int> fds) {
  IpcHandle h;
  h.pages = true;
  h.pid = pid;
  h.page_size = page_size;
  h.fds = std::move(fds);
  return h;
}

TEST(IpcFormatTest, MallocHandleIsVersionKindAndTheCudaHandle) {
  IpcHandle h;
  for (std::size_t i = 0; i < h.malloc.size(); ++i) h.malloc[i] = static_cast<std::uint8_t>(i);
  const std::string bytes = EncodeIpcHandle(h);
  ASSERT_EQ(bytes.size(), 2 + 64u);
  EXPECT_EQ(bytes[0], 2);  // torch 2.11's SHAREABLE_HANDLE_VERSION
  EXPECT_EQ(bytes[1], 'c');
  EXPECT_EQ(std::memcmp(bytes.data() + 2, h.malloc.data(), 64), 0);
  absl::StatusOr<IpcHandle> back = ParseIpcHandle(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_FALSE(back->pages);
  EXPECT_EQ(back->malloc, h.malloc);
}

TEST(IpcFormatTest, PagesHandleHasTorchsHeaderWithZeroPadding) {
  const std::string bytes = EncodeIpcHandle(Pages(4242, 2 << 20, {17, 18, 30}));
  ASSERT_EQ(bytes.size(), 2 + 24 + 3 * 4u);
  EXPECT_EQ(bytes[1], 'e');
  std::int32_t pid = 0, pad = -1, fd = 0;
  std::uint64_t segment_size = 0, num_handles = 0;
  std::memcpy(&pid, bytes.data() + 2, 4);
  std::memcpy(&pad, bytes.data() + 6, 4);
  std::memcpy(&segment_size, bytes.data() + 10, 8);
  std::memcpy(&num_handles, bytes.data() + 18, 8);
  std::memcpy(&fd, bytes.data() + 26 + 8, 4);
  EXPECT_EQ(pid, 4242);
  EXPECT_EQ(pad, 0);  // equal shares must be equal strings: the receiver's cache key
  EXPECT_EQ(segment_size, 2u << 20);
  EXPECT_EQ(num_handles, 3u);
  EXPECT_EQ(fd, 30);
  absl::StatusOr<IpcHandle> back = ParseIpcHandle(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->pages);
  EXPECT_EQ(back->pid, 4242);
  EXPECT_EQ(back->page_size, 2u << 20);
  EXPECT_THAT(back->fds, ::testing::ElementsAre(17, 18, 30));
}

TEST(IpcFormatTest, BareCudaHandleOfOlderTorchIsAMallocHandle) {
  const std::string raw(64, '\x07');
  absl::StatusOr<IpcHandle> h = ParseIpcHandle(raw);
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(h->pages);
  EXPECT_EQ(h->malloc[63], 7);
}

TEST(IpcFormatTest, MalformedInputIsRefusedNamingWhatIsWrong) {
  auto expect_bad = [](const std::string& bytes, const char* what) {
    absl::StatusOr<IpcHandle> h = ParseIpcHandle(bytes);
    ASSERT_FALSE(h.ok()) << what;
    EXPECT_TRUE(absl::IsInvalidArgument(h.status())) << h.status();
    EXPECT_THAT(h.status().message(), HasSubstr(what));
  };
  expect_bad("", "too short");
  expect_bad("\x02", "too short");
  expect_bad(std::string("\x03") + "c" + std::string(64, '\0'), "future version of torch");
  expect_bad(std::string("\x02x") + std::string(64, '\0'), "unexpected or illformed shareable");
  expect_bad(std::string("\x02") + "c" + std::string(63, '\0'), "63 bytes after its kind");
  expect_bad(std::string("\x02") + "e" + std::string(10, '\0'), "less than its 24-byte header");
  std::string good = EncodeIpcHandle(Pages(7, 2 << 20, {3, 4}));
  expect_bad(good.substr(0, good.size() - 1), "lists 2 handles but 7 bytes");
  expect_bad(good + std::string(4, '\0'), "lists 2 handles but 12 bytes");
  expect_bad(EncodeIpcHandle(Pages(7, 0, {3})), "segment_size 0");
  expect_bad(EncodeIpcHandle(Pages(0, 2 << 20, {3})), "pid 0");
  std::string header = EncodeIpcHandle(Pages(7, 2 << 20, {3}));
  header.resize(2 + 24);
  expect_bad(header + std::string(64, '\x01'), "fabric handles");
  std::string huge = EncodeIpcHandle(Pages(7, 2 << 20, {3}));
  const std::uint64_t count = ~std::uint64_t{0};
  std::memcpy(huge.data() + 18, &count, 8);
  expect_bad(huge, "but 4 bytes");
}

}  // namespace
}  // namespace vramledger::core
