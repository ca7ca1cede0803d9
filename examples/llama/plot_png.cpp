#include "examples/llama/plot_png.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string_view>

namespace halyard {
namespace {

// 5x7 glyphs for ASCII 32..126, one byte per column, bit 0 = top row; bit 7 holds the descenders of g j p q y,
// which a 7-row cell would otherwise squash above the baseline.
constexpr uint8_t kFont[95][5] = {
    {0x00, 0x00, 0x00, 0x00, 0x00}, {0x00, 0x00, 0x5F, 0x00, 0x00}, {0x00, 0x07, 0x00, 0x07, 0x00},  //   ! "
    {0x14, 0x7F, 0x14, 0x7F, 0x14}, {0x24, 0x2A, 0x7F, 0x2A, 0x12}, {0x23, 0x13, 0x08, 0x64, 0x62},  // # $ %
    {0x36, 0x49, 0x55, 0x22, 0x50}, {0x00, 0x05, 0x03, 0x00, 0x00}, {0x00, 0x1C, 0x22, 0x41, 0x00},  // & ' (
    {0x00, 0x41, 0x22, 0x1C, 0x00}, {0x08, 0x2A, 0x1C, 0x2A, 0x08}, {0x08, 0x08, 0x3E, 0x08, 0x08},  // ) * +
    {0x00, 0x50, 0x30, 0x00, 0x00}, {0x08, 0x08, 0x08, 0x08, 0x08}, {0x00, 0x60, 0x60, 0x00, 0x00},  // , - .
    {0x20, 0x10, 0x08, 0x04, 0x02}, {0x3E, 0x51, 0x49, 0x45, 0x3E}, {0x00, 0x42, 0x7F, 0x40, 0x00},  // / 0 1
    {0x42, 0x61, 0x51, 0x49, 0x46}, {0x21, 0x41, 0x45, 0x4B, 0x31}, {0x18, 0x14, 0x12, 0x7F, 0x10},  // 2 3 4
    {0x27, 0x45, 0x45, 0x45, 0x39}, {0x3C, 0x4A, 0x49, 0x49, 0x30}, {0x01, 0x71, 0x09, 0x05, 0x03},  // 5 6 7
    {0x36, 0x49, 0x49, 0x49, 0x36}, {0x06, 0x49, 0x49, 0x29, 0x1E}, {0x00, 0x36, 0x36, 0x00, 0x00},  // 8 9 :
    {0x00, 0x56, 0x36, 0x00, 0x00}, {0x08, 0x14, 0x22, 0x41, 0x00}, {0x14, 0x14, 0x14, 0x14, 0x14},  // ; < =
    {0x00, 0x41, 0x22, 0x14, 0x08}, {0x02, 0x01, 0x51, 0x09, 0x06}, {0x32, 0x49, 0x79, 0x41, 0x3E},  // > ? @
    {0x7E, 0x11, 0x11, 0x11, 0x7E}, {0x7F, 0x49, 0x49, 0x49, 0x36}, {0x3E, 0x41, 0x41, 0x41, 0x22},  // A B C
    {0x7F, 0x41, 0x41, 0x22, 0x1C}, {0x7F, 0x49, 0x49, 0x49, 0x41}, {0x7F, 0x09, 0x09, 0x01, 0x01},  // D E F
    {0x3E, 0x41, 0x41, 0x51, 0x32}, {0x7F, 0x08, 0x08, 0x08, 0x7F}, {0x00, 0x41, 0x7F, 0x41, 0x00},  // G H I
    {0x20, 0x40, 0x41, 0x3F, 0x01}, {0x7F, 0x08, 0x14, 0x22, 0x41}, {0x7F, 0x40, 0x40, 0x40, 0x40},  // J K L
    {0x7F, 0x02, 0x04, 0x02, 0x7F}, {0x7F, 0x04, 0x08, 0x10, 0x7F}, {0x3E, 0x41, 0x41, 0x41, 0x3E},  // M N O
    {0x7F, 0x09, 0x09, 0x09, 0x06}, {0x3E, 0x41, 0x51, 0x21, 0x5E}, {0x7F, 0x09, 0x19, 0x29, 0x46},  // P Q R
    {0x46, 0x49, 0x49, 0x49, 0x31}, {0x01, 0x01, 0x7F, 0x01, 0x01}, {0x3F, 0x40, 0x40, 0x40, 0x3F},  // S T U
    {0x1F, 0x20, 0x40, 0x20, 0x1F}, {0x7F, 0x20, 0x18, 0x20, 0x7F}, {0x63, 0x14, 0x08, 0x14, 0x63},  // V W X
    {0x03, 0x04, 0x78, 0x04, 0x03}, {0x61, 0x51, 0x49, 0x45, 0x43}, {0x00, 0x7F, 0x41, 0x41, 0x00},  // Y Z [
    {0x02, 0x04, 0x08, 0x10, 0x20}, {0x00, 0x41, 0x41, 0x7F, 0x00}, {0x04, 0x02, 0x01, 0x02, 0x04},  // \ ] ^
    {0x40, 0x40, 0x40, 0x40, 0x40}, {0x00, 0x01, 0x02, 0x04, 0x00}, {0x20, 0x54, 0x54, 0x54, 0x78},  // _ ` a
    {0x7F, 0x48, 0x44, 0x44, 0x38}, {0x38, 0x44, 0x44, 0x44, 0x20}, {0x38, 0x44, 0x44, 0x48, 0x7F},  // b c d
    {0x38, 0x54, 0x54, 0x54, 0x18}, {0x08, 0x7E, 0x09, 0x01, 0x02}, {0x98, 0xA4, 0xA4, 0xA4, 0x7C},  // e f g
    {0x7F, 0x08, 0x04, 0x04, 0x78}, {0x00, 0x44, 0x7D, 0x40, 0x00}, {0x40, 0x80, 0x84, 0x7D, 0x00},  // h i j
    {0x7F, 0x10, 0x28, 0x44, 0x00}, {0x00, 0x41, 0x7F, 0x40, 0x00}, {0x7C, 0x04, 0x18, 0x04, 0x78},  // k l m
    {0x7C, 0x08, 0x04, 0x04, 0x78}, {0x38, 0x44, 0x44, 0x44, 0x38}, {0xFC, 0x24, 0x24, 0x24, 0x18},  // n o p
    {0x18, 0x24, 0x24, 0x24, 0xFC}, {0x7C, 0x08, 0x04, 0x04, 0x08}, {0x48, 0x54, 0x54, 0x54, 0x20},  // q r s
    {0x04, 0x3F, 0x44, 0x40, 0x20}, {0x3C, 0x40, 0x40, 0x20, 0x7C}, {0x1C, 0x20, 0x40, 0x20, 0x1C},  // t u v
    {0x3C, 0x40, 0x30, 0x40, 0x3C}, {0x44, 0x28, 0x10, 0x28, 0x44}, {0x9C, 0xA0, 0xA0, 0xA0, 0x7C},  // w x y
    {0x44, 0x64, 0x54, 0x4C, 0x44}, {0x00, 0x08, 0x36, 0x41, 0x00}, {0x00, 0x00, 0x7F, 0x00, 0x00},  // z { |
    {0x00, 0x41, 0x36, 0x08, 0x00}, {0x08, 0x04, 0x08, 0x10, 0x08},                                  // } ~
};

constexpr int kScale = 2;               // every glyph is drawn 2x: 5x7 pixels are too small to read
constexpr int kCharH = 7 * kScale;      // height of a line of text
constexpr int kAdvance = 6 * kScale;    // glyph plus one column of spacing

struct Rgb {
  uint8_t r, g, b;
  bool operator==(const Rgb&) const = default;
};
constexpr Rgb kWhite{255, 255, 255}, kInk{30, 30, 30}, kGrid{225, 225, 225}, kFrame{90, 90, 90};
// Tableau's ten colours: distinct from each other and readable on white.
constexpr Rgb kPalette[] = {{31, 119, 180}, {255, 127, 14}, {44, 160, 44},  {214, 39, 40},   {148, 103, 189},
                            {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207}};

int text_width(std::string_view s) { return s.empty() ? 0 : int(s.size()) * kAdvance - kScale; }

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), rgb_(size_t(w) * h * 3, 255) {}
  int width() const { return w_; }
  int height() const { return h_; }
  const std::vector<uint8_t>& rgb() const { return rgb_; }

  Rgb get(int x, int y) const {
    const uint8_t* p = &rgb_[(size_t(y) * w_ + x) * 3];
    return {p[0], p[1], p[2]};
  }
  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;  // callers draw freely; clipping lives here
    uint8_t* p = &rgb_[(size_t(y) * w_ + x) * 3];
    p[0] = c.r, p[1] = c.g, p[2] = c.b;
  }
  void fill(int x0, int y0, int x1, int y1, Rgb c) {  // inclusive corners
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  void rect(int x0, int y0, int x1, int y1, Rgb c) {
    line(x0, y0, x1, y0, c), line(x0, y1, x1, y1, c), line(x0, y0, x0, y1, c), line(x1, y0, x1, y1, c);
  }
  void disc(int cx, int cy, int r, Rgb c) {
    for (int dy = -r; dy <= r; ++dy)
      for (int dx = -r; dx <= r; ++dx)
        if (dx * dx + dy * dy <= r * r + 1) set(cx + dx, cy + dy, c);
  }

  // Bresenham with a square brush; dash > 0 alternates `dash` drawn and `dash` skipped steps.
  void line(int x0, int y0, int x1, int y1, Rgb c, int thick = 1, int dash = 0) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    for (int err = dx + dy, step = 0;; ++step) {
      const int lo = (thick - 1) / 2, hi = thick / 2;  // a 2 px brush covers the point and its right/lower neighbour
      if (dash <= 0 || (step / dash) % 2 == 0) fill(x0 - lo, y0 - lo, x0 + hi, y0 + hi, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }

  // (x, y) is the top-left corner; vertical text reads bottom to top and (x, y) is then its bottom-left.
  void text(int x, int y, std::string_view s, Rgb c, bool vertical = false) {
    for (size_t i = 0; i < s.size(); ++i) {
      const unsigned ch = static_cast<unsigned char>(s[i]);
      const uint8_t* glyph = kFont[(ch >= 32 && ch <= 126 ? ch : '?') - 32];
      for (int col = 0; col < 5; ++col)
        for (int row = 0; row < 8; ++row) {
          if (!(glyph[col] >> row & 1)) continue;
          const int u = int(i) * kAdvance + col * kScale, v = row * kScale;  // along, across the text
          if (vertical)
            fill(x + v, y - u - kScale + 1, x + v + kScale - 1, y - u, c);
          else
            fill(x + u, y + v, x + u + kScale - 1, y + v + kScale - 1, c);
        }
    }
  }

 private:
  int w_, h_;
  std::vector<uint8_t> rgb_;
};

// ---- PNG encoding --------------------------------------------------------------------------------------------

uint32_t crc32(const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t adler32(const std::vector<uint8_t>& data) {
  uint32_t a = 1, b = 0;
  for (uint8_t byte : data) a = (a + byte) % 65521, b = (b + a) % 65521;
  return b << 16 | a;
}

void put32(std::vector<uint8_t>& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(uint8_t(v >> shift));
}

void append_chunk(std::vector<uint8_t>& png, const char* type, const std::vector<uint8_t>& data) {
  put32(png, uint32_t(data.size()));
  const size_t start = png.size();  // the CRC covers the type and the data, not the length
  png.insert(png.end(), type, type + 4);
  png.insert(png.end(), data.begin(), data.end());
  put32(png, crc32(&png[start], png.size() - start));
}

std::vector<uint8_t> encode_png(const Canvas& cv) {
  const size_t row_bytes = size_t(cv.width()) * 3;
  std::vector<uint8_t> raw;
  raw.reserve(cv.height() * (row_bytes + 1));
  for (int y = 0; y < cv.height(); ++y) {
    raw.push_back(0);  // filter "none": filters only pay off when the data is compressed
    raw.insert(raw.end(), cv.rgb().begin() + y * row_bytes, cv.rgb().begin() + (y + 1) * row_bytes);
  }
  std::vector<uint8_t> z = {0x78, 0x01};  // zlib header: deflate, 32K window, check bits valid
  for (size_t pos = 0;;) {
    const size_t n = std::min<size_t>(65535, raw.size() - pos);  // a stored block holds at most 64K - 1 bytes
    const bool last = pos + n == raw.size();
    z.insert(z.end(), {uint8_t(last), uint8_t(n), uint8_t(n >> 8), uint8_t(~n), uint8_t(~n >> 8)});
    z.insert(z.end(), raw.begin() + pos, raw.begin() + pos + n);
    if (last) break;
    pos += n;
  }
  put32(z, adler32(raw));

  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'}, ihdr;
  put32(ihdr, cv.width());
  put32(ihdr, cv.height());
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, deflate, adaptive filtering, no interlace
  append_chunk(png, "IHDR", ihdr);
  append_chunk(png, "IDAT", z);
  append_chunk(png, "IEND", {});
  return png;
}

// ---- Axes ----------------------------------------------------------------------------------------------------

struct Tick {
  double at;  // in axis units (log2 of x on a log axis)
  std::string label;
};
struct Axis {
  double lo, hi;
  std::vector<Tick> ticks;
};

// Ticks at 1, 2, 2.5 or 5 times a power of ten, about six intervals, the ends rounded out to a tick.
Axis linear_axis(double lo, double hi) {
  if (hi - lo <= 1e-12 * std::max(1.0, std::abs(hi))) {  // one value: pad so it sits mid-chart
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad, hi += pad;
  }
  const double raw = (hi - lo) / 6, mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = 10 * mag;
  for (double m : {1.0, 2.0, 2.5, 5.0})
    if (m * mag >= raw * (1 - 1e-9)) {
      step = m * mag;
      break;
    }
  int decimals = 0;
  while (decimals < 9 && std::abs(step * std::pow(10.0, decimals) - std::round(step * std::pow(10.0, decimals))) > 1e-6)
    ++decimals;
  const auto i0 = std::llround(std::floor(lo / step + 1e-9)), i1 = std::llround(std::ceil(hi / step - 1e-9));
  Axis axis{double(i0) * step, double(i1) * step, {}};
  for (long long i = i0; i <= i1; ++i) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, double(i) * step);
    axis.ticks.push_back({double(i) * step, buf});
  }
  return axis;
}

std::string pow2_label(int e) {
  char buf[64];
  if (e < 0) {
    std::snprintf(buf, sizeof buf, "1/%.0f", std::ldexp(1.0, -e));
  } else {
    static const char* const kSuffix[] = {"", "K", "M", "G", "T"};
    const int k = std::min(e / 10, 4);  // binary prefixes: sequence lengths are powers of two
    std::snprintf(buf, sizeof buf, "%.0f%s", std::ldexp(1.0, e - 10 * k), kSuffix[k]);
  }
  return buf;
}

// lo and hi are log2 values; ticks at whole powers of two, every k-th one so there are at most eight.
Axis log2_axis(double lo, double hi) {
  int e0 = int(std::floor(lo + 1e-9)), e1 = int(std::ceil(hi - 1e-9));
  if (e1 <= e0) --e0, ++e1;
  const int k = std::max(1, (e1 - e0 + 6) / 7);
  e1 = e0 + k * ((e1 - e0 + k - 1) / k);
  Axis axis{double(e0), double(e1), {}};
  for (int e = e0; e <= e1; e += k) axis.ticks.push_back({double(e), pow2_label(e)});
  return axis;
}

Canvas draw_chart(const PlotSpec& spec) {
  const int W = std::max(spec.width, 320), H = std::max(spec.height, 240);
  auto usable = [&](double x, double y) { return std::isfinite(x) && std::isfinite(y) && (!spec.log_x || x > 0); };
  auto tx = [&](double x) { return spec.log_x ? std::log2(x) : x; };

  constexpr double kInf = std::numeric_limits<double>::infinity();
  double xmin = kInf, xmax = -kInf, ymin = kInf, ymax = -kInf;
  for (const PlotSeries& s : spec.series)
    for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i)
      if (usable(s.x[i], s.y[i])) {
        xmin = std::min(xmin, tx(s.x[i])), xmax = std::max(xmax, tx(s.x[i]));
        ymin = std::min(ymin, s.y[i]), ymax = std::max(ymax, s.y[i]);
      }
  const bool has_hline = spec.hline > 0 && std::isfinite(spec.hline);
  if (has_hline) ymin = std::min(ymin, spec.hline), ymax = std::max(ymax, spec.hline);
  if (xmin > xmax) xmin = spec.log_x ? 10 : 0, xmax = spec.log_x ? 20 : 1;  // no data: still draw the axes
  if (ymin > ymax) ymin = 0, ymax = 1;
  if (ymin > 0 && ymin <= 0.5 * ymax) ymin = 0;  // sizes and rates read better from zero unless that wastes the chart
  const Axis xa = spec.log_x ? log2_axis(xmin, xmax) : linear_axis(xmin, xmax);
  Axis ya = linear_axis(ymin, ymax);
  if (has_hline && ya.hi - spec.hline < 0.03 * (ya.hi - ya.lo))  // a dashed line on the frame would be invisible
    ya = linear_axis(ymin, spec.hline + 0.05 * (ya.hi - ya.lo));

  int ytick_w = 0;
  for (const Tick& t : ya.ticks) ytick_w = std::max(ytick_w, text_width(t.label));
  const int left = 12 + (spec.y_label.empty() ? 0 : kCharH + 12) + ytick_w + 12;
  const int top = 16 + kCharH + 16;
  const int right = W - 40;  // room for half of the last x tick label
  const int bottom = H - (10 + kCharH + 12 + (spec.x_label.empty() ? 0 : kCharH + 12));
  auto px = [&](double x) { return int(std::lround(left + (tx(x) - xa.lo) / (xa.hi - xa.lo) * (right - left))); };
  auto py = [&](double y) { return int(std::lround(bottom - (y - ya.lo) / (ya.hi - ya.lo) * (bottom - top))); };

  Canvas cv(W, H);
  cv.text(std::max(4, (W - text_width(spec.title)) / 2), 16, spec.title, kInk);
  cv.text(std::max(4, (left + right - text_width(spec.x_label)) / 2), H - 12 - kCharH, spec.x_label, kInk);
  cv.text(12, std::min(H - 4, (top + bottom + text_width(spec.y_label)) / 2), spec.y_label, kInk, true);
  for (const Tick& t : xa.ticks) {
    const int x = int(std::lround(left + (t.at - xa.lo) / (xa.hi - xa.lo) * (right - left)));
    cv.line(x, top, x, bottom, kGrid);
    cv.line(x, bottom, x, bottom + 5, kFrame);
    cv.text(x - text_width(t.label) / 2, bottom + 10, t.label, kInk);
  }
  for (const Tick& t : ya.ticks) {
    const int y = py(t.at);
    cv.line(left, y, right, y, kGrid);
    cv.line(left - 5, y, left, y, kFrame);
    cv.text(left - 10 - text_width(t.label), y - kCharH / 2, t.label, kInk);
  }
  cv.rect(left, top, right, bottom, kFrame);

  if (has_hline) {
    const int y = py(spec.hline);
    cv.line(left, y, right, y, kInk, 2, 8);
    const int label_y = y - kCharH - 6 > top + 2 ? y - kCharH - 6 : y + 8;  // below when the line is at the top
    cv.text(right - 8 - text_width(spec.hline_label), label_y, spec.hline_label, kInk);
  }

  // Lines first, then every marker, so no line crosses over a point. A skipped point leaves a gap: joining its
  // neighbours would draw a value nobody measured.
  for (int pass = 0; pass < 2; ++pass)
    for (size_t si = 0; si < spec.series.size(); ++si) {
      const PlotSeries& s = spec.series[si];
      const Rgb c = kPalette[si % std::size(kPalette)];
      bool have_prev = false;
      int x0 = 0, y0 = 0;
      for (size_t i = 0; i < std::min(s.x.size(), s.y.size()); ++i) {
        if (!usable(s.x[i], s.y[i])) {
          have_prev = false;
          continue;
        }
        const int x1 = px(s.x[i]), y1 = py(s.y[i]);
        if (pass == 0 && have_prev) cv.line(x0, y0, x1, y1, c, 2);
        if (pass == 1) cv.disc(x1, y1, 3, c);
        x0 = x1, y0 = y1, have_prev = true;
      }
    }

  // Legend: in whichever inner corner of the plot covers the fewest already drawn data pixels.
  int name_w = 0;
  for (const PlotSeries& s : spec.series) name_w = std::max(name_w, text_width(s.name));
  if (name_w > 0) {
    const int row_h = kCharH + 8, box_w = 8 + 28 + 8 + name_w + 10, box_h = 4 + row_h * int(spec.series.size());
    int best_x = left + 10, best_y = top + 10, best_cost = -1;
    for (int corner = 0; corner < 4; ++corner) {
      const int bx = corner & 1 ? right - 10 - box_w : left + 10, by = corner & 2 ? bottom - 10 - box_h : top + 10;
      int cost = 0;
      for (int y = std::max(by - 8, 0); y <= std::min(by + box_h + 8, H - 1); ++y)  // 8 px: keep clear of data
        for (int x = std::max(bx - 8, 0); x <= std::min(bx + box_w + 8, W - 1); ++x) {
          const Rgb p = cv.get(x, y);
          cost += p == kWhite || p == kGrid ? 0 : p == kInk ? 1 : 4;  // hiding data is worse than hiding the hline
        }
      if (best_cost < 0 || cost < best_cost) best_cost = cost, best_x = bx, best_y = by;
    }
    cv.fill(best_x, best_y, best_x + box_w, best_y + box_h, kWhite);
    cv.rect(best_x, best_y, best_x + box_w, best_y + box_h, kFrame);
    for (size_t si = 0; si < spec.series.size(); ++si) {
      const Rgb c = kPalette[si % std::size(kPalette)];
      const int y = best_y + 6 + row_h * int(si);
      cv.line(best_x + 8, y + kCharH / 2, best_x + 36, y + kCharH / 2, c, 2);
      cv.disc(best_x + 22, y + kCharH / 2, 3, c);
      cv.text(best_x + 44, y, spec.series[si].name, kInk);
    }
  }

  return cv;
}

void write_png(const std::string& path, const Canvas& cv) {
  const std::vector<uint8_t> png = encode_png(cv);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(png.data()), std::streamsize(png.size()));
  out.close();
  if (!out) throw std::runtime_error("write_line_plot_png: cannot write " + path);
}

}  // namespace

void write_line_plot_png(const std::string& path, const PlotSpec& spec) { write_png(path, draw_chart(spec)); }

void write_line_plots_png(const std::string& path, const std::vector<PlotSpec>& panels) {
  std::vector<Canvas> charts;
  int W = 0, H = 0;
  for (const PlotSpec& spec : panels) {
    charts.push_back(draw_chart(spec));
    W = std::max(W, charts.back().width());
    H += charts.back().height();
  }
  Canvas all(std::max(W, 1), std::max(H, 1));
  int at = 0;
  for (const Canvas& c : charts) {
    for (int y = 0; y < c.height(); ++y)
      for (int x = 0; x < c.width(); ++x) all.set(x, at + y, c.get(x, y));
    at += c.height();
  }
  write_png(path, all);
}

}  // namespace halyard
