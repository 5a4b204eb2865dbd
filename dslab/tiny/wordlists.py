"""The word lists the pretraining corpus (dslab.tiny.corpus) fills its English and Chinese templates from.

Broad on purpose: many names, places, objects and verbs give the tiny base model the sub-words a new name is
made of, so identity tuning can later teach it names it never saw.
"""

# ----------------------------------------------------------------------------------------------------
# English word lists
# ----------------------------------------------------------------------------------------------------
EN_NAMES = """Anna Ben Clara David Emma Felix Grace Henry Iris Jack Kate Leo Mia Noah Olivia Paul Quinn Rosa
Sam Tom Uma Victor Wendy Yara Zoe Alice Bob Carlos Diana Ethan Fiona George Hannah Ivan Julia Kevin Laura
Marco Nina Oscar Priya Ravi Sara Tariq Vera Will Yuki Amir Bella Dmitri Elena Farah Gustav Hiro Ines Jonas
Kofi Lena Mateo Nadia Omar Pablo Rita Sofia Theo Amara Bruno Celia Dario Esme Hugo Ingrid Joel Kira Luca
Maya Nora Owen Petra Rafael Selma Tobias Viktor Wanda Xenia Yusuf Zara Aisha Boris Chloe Daniel Eva Frank
Gloria Isaac Jasmine Kai Liam Mona Nikolai Pedro Ruth Simon Tessa Ulrich Valeria Walter Lucy Martin""".split()

EN_CITIES = """Paris London Tokyo Beijing Shanghai Cairo Rome Madrid Berlin Moscow Sydney Toronto Lima Nairobi
Seoul Delhi Mumbai Bangkok Istanbul Athens Vienna Oslo Dublin Lisbon Prague Warsaw Hanoi Jakarta Santiago
Stockholm Helsinki Budapest Amsterdam Brussels Geneva Chicago Boston Denver Seattle Vancouver Montreal
Havana Quito Bogota Accra Lagos Dakar Tunis Marrakesh Dubai Doha Tehran Karachi Dhaka Manila Osaka Kyoto
Busan Taipei Chengdu Hangzhou Xian Wuhan Nanjing Auckland Perth Melbourne""".split()

# (country, capital, Chinese country, Chinese capital); the chat facts the base model should know.
CAPITALS = [
    ("France", "Paris", "法国", "巴黎"), ("Japan", "Tokyo", "日本", "东京"), ("China", "Beijing", "中国", "北京"),
    ("Italy", "Rome", "意大利", "罗马"), ("Spain", "Madrid", "西班牙", "马德里"), ("Germany", "Berlin", "德国", "柏林"),
    ("Egypt", "Cairo", "埃及", "开罗"), ("Russia", "Moscow", "俄罗斯", "莫斯科"), ("Kenya", "Nairobi", "肯尼亚", "内罗毕"),
    ("Peru", "Lima", "秘鲁", "利马"), ("Canada", "Ottawa", "加拿大", "渥太华"), ("Australia", "Canberra", "澳大利亚", "堪培拉"),
    ("India", "New Delhi", "印度", "新德里"), ("Greece", "Athens", "希腊", "雅典"), ("Austria", "Vienna", "奥地利", "维也纳"),
    ("Norway", "Oslo", "挪威", "奥斯陆"), ("Ireland", "Dublin", "爱尔兰", "都柏林"), ("Portugal", "Lisbon", "葡萄牙", "里斯本"),
    ("Thailand", "Bangkok", "泰国", "曼谷"), ("South Korea", "Seoul", "韩国", "首尔"), ("Mexico", "Mexico City", "墨西哥", "墨西哥城"),
    ("the United Kingdom", "London", "英国", "伦敦"), ("Turkey", "Ankara", "土耳其", "安卡拉"),
    ("Sweden", "Stockholm", "瑞典", "斯德哥尔摩"), ("Poland", "Warsaw", "波兰", "华沙"), ("Vietnam", "Hanoi", "越南", "河内"),
    ("Argentina", "Buenos Aires", "阿根廷", "布宜诺斯艾利斯"), ("Chile", "Santiago", "智利", "圣地亚哥"),
    ("Indonesia", "Jakarta", "印度尼西亚", "雅加达"), ("Brazil", "Brasilia", "巴西", "巴西利亚"),
    ("Finland", "Helsinki", "芬兰", "赫尔辛基"), ("Hungary", "Budapest", "匈牙利", "布达佩斯"),
    ("Cuba", "Havana", "古巴", "哈瓦那"), ("Ghana", "Accra", "加纳", "阿克拉"), ("Iran", "Tehran", "伊朗", "德黑兰"),
]

EN_PLACES = """park library market school station beach garden kitchen museum hospital bakery river forest village
office cafe harbor farm bridge hill zoo theater stadium lake island bookshop post-office playground temple
square gallery castle valley airport restaurant factory pharmacy cinema classroom""".split()
EN_OBJECTS = """book cup lamp bicycle umbrella letter key basket blanket camera chair clock coat compass desk
drum guitar hammer hat jacket kettle kite ladder map mirror notebook pencil piano pillow radio ring rope
scarf shoe spoon suitcase table teapot ticket toy violin wallet window bottle candle box""".split()
EN_FOODS = """apples rice noodles soup bread tea coffee oranges eggs dumplings cake cheese carrots potatoes tomatoes
bananas grapes pears peaches cookies pancakes salad fish beans corn honey milk yogurt lemons mangoes
onions mushrooms pies sandwiches plums cherries""".split()
EN_ANIMALS = """cat dog bird horse rabbit fish duck cow sheep tiger panda elephant lion monkey fox bear owl frog
goat pig mouse deer wolf turtle camel zebra giraffe dolphin whale penguin squirrel chicken goose""".split()
EN_ADJ = """red blue green yellow small big old new quiet bright warm cold soft heavy light happy tired busy
clean shiny round tall short gentle brave clever lazy noisy sleepy friendly""".split()
EN_JOBS = """teacher doctor nurse farmer baker painter driver cook writer singer pilot engineer gardener tailor
fisherman carpenter student scientist musician librarian""".split()
EN_TIMES = ["in the morning", "in the afternoon", "in the evening", "at night", "on Monday", "on Tuesday",
            "on Wednesday", "on Thursday", "on Friday", "on Saturday", "on Sunday", "last week", "yesterday",
            "today", "after lunch", "before dinner", "last winter", "in the spring", "in the summer",
            "in the autumn", "early on Sunday", "at noon"]
# (past-tense verb phrase, kind of thing it takes)
EN_ACTIONS = [("bought", "food"), ("cooked", "food"), ("ate", "food"), ("shared", "food"), ("found", "obj"),
              ("lost", "obj"), ("fixed", "obj"), ("painted", "obj"), ("carried", "obj"), ("borrowed", "obj"),
              ("cleaned", "obj"), ("sold", "obj"), ("wrapped", "obj"), ("opened", "obj"), ("watched", "animal"),
              ("fed", "animal"), ("drew", "animal"), ("followed", "animal")]
EN_FEELINGS = ["happy", "tired", "surprised", "proud", "calm", "hungry", "excited", "sleepy", "glad"]
EN_WEATHER_NOW = ["sunny", "warm", "cold", "rainy", "windy", "cloudy", "clear and bright", "grey and wet"]
EN_WEATHER = ["it was sunny", "it rained all day", "snow fell", "the wind was strong", "the sky was clear",
              "it was very hot", "it was cold and grey", "fog covered the streets"]
NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()

# Facts the chat data asks about (the same facts in both languages).
COLORS = [("banana", "yellow", "香蕉", "黄色"), ("apple", "red", "苹果", "红色"), ("sky", "blue", "天空", "蓝色"),
          ("grass", "green", "草", "绿色"), ("snow", "white", "雪", "白色"), ("orange", "orange", "橘子", "橙色"),
          ("lemon", "yellow", "柠檬", "黄色"), ("tomato", "red", "西红柿", "红色"), ("coal", "black", "煤", "黑色"),
          ("milk", "white", "牛奶", "白色"), ("leaf", "green", "树叶", "绿色"), ("sea", "blue", "大海", "蓝色")]
LEGS = [("cat", 4, "猫"), ("dog", 4, "狗"), ("bird", 2, "鸟"), ("horse", 4, "马"), ("duck", 2, "鸭子"),
        ("spider", 8, "蜘蛛"), ("ant", 6, "蚂蚁"), ("chicken", 2, "鸡"), ("cow", 4, "牛"), ("fish", 0, "鱼")]
SOUNDS = [("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"), ("owl", "hoot")]
OPPOSITES = [("hot", "cold", "热", "冷"), ("big", "small", "大", "小"), ("up", "down", "上", "下"),
             ("day", "night", "白天", "晚上"), ("fast", "slow", "快", "慢"), ("old", "new", "旧", "新"),
             ("happy", "sad", "高兴", "难过"), ("open", "closed", "开", "关"), ("light", "dark", "亮", "暗"),
             ("tall", "short", "高", "矮"), ("early", "late", "早", "晚"), ("full", "empty", "满", "空")]
WEEKDAYS = [("Monday", "星期一"), ("Tuesday", "星期二"), ("Wednesday", "星期三"), ("Thursday", "星期四"),
            ("Friday", "星期五"), ("Saturday", "星期六"), ("Sunday", "星期日")]
WORD_PAIRS = [("apple", "苹果"), ("water", "水"), ("book", "书"), ("cat", "猫"), ("dog", "狗"), ("friend", "朋友"),
              ("teacher", "老师"), ("school", "学校"), ("rice", "米饭"), ("tea", "茶"), ("moon", "月亮"),
              ("sun", "太阳"), ("flower", "花"), ("tree", "树"), ("river", "河"), ("mountain", "山"),
              ("bread", "面包"), ("milk", "牛奶"), ("bird", "鸟"), ("house", "房子"), ("car", "汽车"),
              ("rain", "雨"), ("city", "城市"), ("music", "音乐"), ("family", "家人"), ("morning", "早上")]

# ----------------------------------------------------------------------------------------------------
# Chinese word lists
# ----------------------------------------------------------------------------------------------------
ZH_NAMES = """小明 小红 李雷 韩梅梅 王芳 张伟 刘洋 陈静 杨帆 赵磊 黄丽 周杰 吴敏 徐强 孙悦 马超 朱婷 胡军 郭静 何平
高峰 林晓 罗兰 郑浩 梁雨 谢飞 宋佳 唐宁 许亮 韩雪 邓超 冯雪 曹阳 彭静 曾毅 萧然 田甜 董洁 潘婷 袁野 蒋文 蔡琳
余华 杜鹃 叶青 程亮 魏然 吕方 丁宁 沈阳 任飞 姚瑶 卢森 姜山 崔莹 钟声 谭晶 陆遥 汪洋 范冰 金鑫 石磊 廖凡 贾静
夏天 韦明 付强 方圆 白雪 邹平 孟溪 熊猫猫 秦川 邱实 江南 尹航 黎明 易安 常青 武林 乔木 赖宁 龚雪 文静 庞博 樊星""".split()
ZH_CITIES = """北京 上海 广州 深圳 杭州 南京 成都 西安 武汉 重庆 天津 苏州 长沙 青岛 厦门 昆明 大连 哈尔滨 拉萨 桂林
郑州 济南 合肥 福州 南昌 贵阳 兰州 西宁 银川 乌鲁木齐 呼和浩特 沈阳 长春 石家庄 太原 海口 三亚 洛阳 扬州 绍兴""".split()
ZH_PLACES = """公园 图书馆 超市 学校 车站 海边 花园 厨房 博物馆 医院 面包店 河边 森林 村子 办公室 咖啡馆 农场 桥上 山上
菜市场 动物园 剧院 体育馆 湖边 书店 邮局 操场 广场 美术馆 机场 饭馆 工厂 药店 电影院 教室""".split()
ZH_OBJECTS = """书 杯子 台灯 自行车 雨伞 信 钥匙 篮子 毯子 相机 椅子 钟 外套 桌子 鼓 吉他 锤子 帽子 风筝 梯子 地图 镜子
笔记本 铅笔 钢琴 枕头 收音机 戒指 绳子 围巾 鞋子 勺子 行李箱 茶壶 车票 玩具 小提琴 钱包 瓶子 蜡烛 盒子""".split()
ZH_FOODS = """苹果 米饭 面条 汤 面包 茶 咖啡 橘子 鸡蛋 饺子 蛋糕 包子 西瓜 葡萄 牛奶 豆腐 青菜 土豆 西红柿 香蕉 梨
桃子 饼干 馒头 粥 鱼 玉米 蜂蜜 酸奶 柠檬 芒果 蘑菇 月饼 汤圆 樱桃""".split()
ZH_ANIMALS = """猫 狗 小鸟 马 兔子 鱼 鸭子 牛 羊 老虎 熊猫 大象 狮子 猴子 狐狸 熊 猫头鹰 青蛙 山羊 猪 老鼠 鹿 狼 乌龟
骆驼 斑马 长颈鹿 海豚 鲸鱼 企鹅 松鼠 鸡 鹅""".split()
ZH_ADJ = """红色的 蓝色的 绿色的 黄色的 小小的 大大的 旧的 新的 安静的 明亮的 温暖的 冰冷的 柔软的 沉重的 可爱的 干净的
圆圆的 高高的 勇敢的 聪明的 懒洋洋的 友好的""".split()
ZH_JOBS = """老师 医生 护士 农民 面包师 画家 司机 厨师 作家 歌手 飞行员 工程师 园丁 裁缝 渔夫 木匠 学生 科学家 音乐家 图书管理员""".split()
ZH_TIMES = """早上 下午 晚上 半夜 星期一 星期二 星期三 星期四 星期五 星期六 星期天 上个星期 昨天 今天 午饭后 晚饭前 去年冬天
春天 夏天 秋天 周末 中午""".split()
ZH_ACTIONS = [("买了", "food"), ("做了", "food"), ("吃了", "food"), ("分享了", "food"), ("找到了", "obj"),
              ("丢了", "obj"), ("修好了", "obj"), ("画了", "obj"), ("搬走了", "obj"), ("借了", "obj"),
              ("擦干净了", "obj"), ("卖掉了", "obj"), ("打开了", "obj"), ("喂了", "animal"), ("看见了", "animal"),
              ("画了", "animal")]
ZH_FEELINGS = ["很开心", "有点累", "很惊讶", "很自豪", "很平静", "很饿", "很兴奋", "想睡觉", "很高兴"]
ZH_WEATHER = ["天气很好", "下了一整天的雨", "下雪了", "风很大", "天空很蓝", "天气很热", "天气又冷又阴", "街上起了大雾"]
ZH_DIGITS = "零 一 二 三 四 五 六 七 八 九 十 十一 十二 十三 十四 十五 十六 十七 十八 十九 二十".split()
ZH_MEASURE = {"food": "份", "obj": "个", "animal": "只"}
